"""A user's ``TrainState`` sharded with FSDP2 ``fully_shard``, and its state as pieces.

The user's ``build(layout)`` returns a plain model and an optimizer over its parameters, as
for data parallelism; :func:`shard_train_state` shards it over the round's mesh (FSDP, or HSDP
on a replicate x shard mesh) and points the optimizer at the sharded parameters. Units: every
module that owns parameters is one ``fully_shard`` unit (children first), then the root, so any
model works without naming its layers. Gradients are *summed* over the data-parallel ranks
(divide factor 1), as ``grad_sync`` does for replicated models: each rank already weights its
loss by its share of the global batch.

A rank's **piece** is what it holds of the state: its rows (dim 0) of every parameter and of
every optimizer tensor shaped like one, plus what is whole everywhere (buffers, step counts,
hyperparameters). Pieces ``0..shard-1`` of one step, concatenated in order, are the full state
(FSDP2 splits dim 0 like ``torch.chunk``); a rank of a new layout needs only the rows its own
piece of that layout covers, which ``row_fetch.fetch_rows`` brings from the old pieces'
holders. So state moves between any two layouts of the shard axis, FSDP, HSDP and plain
replicas alike, by name.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.runtime_step import initialize_optimizer_state

logger = logging.getLogger(__name__)

Piece = dict[str, Any]
"""``{"params", "optim_rows", "optim_whole", "buffers", "groups"}``: one rank's part."""


@dataclass(frozen=True, slots=True)
class RowSpec:
    """A row-cut tensor of the state: where it lives in a piece, its full shape and dtype."""

    side: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def shard_train_state(state: TrainState, mesh: DeviceMesh, *,
                      param_dtype: torch.dtype | None = None) -> None:
    """Shard ``state.model`` over ``mesh`` in place and re-point its optimizer.

    With ``param_dtype`` (``run(autocast_dtype=torch.bfloat16)``) FSDP's own mixed
    precision computes in that dtype: the gathered parameters and the forward's inputs
    are cast to it, gradients are reduced in float32, and the optimizer keeps float32
    shards (``MixedPrecisionPolicy``; torchtitan's choice, instead of autocast).

    The optimizer must not hold state yet (it is built, never stepped, by ``build``).
    """
    model = state.model
    names = {id(p): name for name, p in model.named_parameters()}
    policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
              if param_dtype is not None else MixedPrecisionPolicy())
    for module in reversed(list(model.modules())):
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A plain sum (gloo has no pre-multiplied sum): losses are weighted by share.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    _repoint(state, names)


def _repoint(state: TrainState, names: dict[int, str]) -> None:
    """Point the optimizer at the model's parameters of the same names (``names``: the
    names of the parameters it held, by id) after they were replaced."""
    now = dict(state.model.named_parameters())
    for group in state.optimizer.param_groups:
        group["params"] = [now[names[id(p)]] for p in group["params"]]


class ShardedGradients:
    """The gradient reducer for a sharded model: FSDP reduces during backward.

    Same calls as ``grad_sync.GradientBuckets``; only a step's last backward reduces
    (the others accumulate, like DDP's ``no_sync``).

    With ``accumulates`` (``micro_batch_size`` is set) ranks may run different numbers of
    micro-batches in a step (the sampler splits the global batch unevenly), but FSDP's
    collectives must match rank for rank. So the gathered parameters are kept from the
    step's first forward to its last backward: every rank all-gathers once, in its first
    forward, and reduce-scatters once, in its last backward, whatever its count; the
    micro-batches between issue no collective. Costs the full parameters' memory (not
    the gradients' or the optimizer's) during the step, as ZeRO-2 does.
    """

    def __init__(self, model: torch.nn.Module, *, accumulates: bool = False) -> None:
        if not isinstance(model, FSDPModule):
            raise TypeError("ShardedGradients needs a model sharded by fully_shard")
        self.model: Any = model
        self.accumulates = accumulates
        if accumulates:
            self.model.set_reshard_after_forward(False)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def begin(self, *, is_last_backward: bool) -> None:
        self.model.set_requires_gradient_sync(is_last_backward)
        if self.accumulates:
            # the last backward leaves only the shards, for the optimizer and the copies
            self.model.set_reshard_after_backward(is_last_backward)

    def finish(self) -> None:
        """Nothing left: FSDP's root waits for its reduce-scatters at the end of backward."""

    def close(self) -> None:
        """Nothing to remove: the model dies with its round."""


def put_shards_back(model: torch.nn.Module) -> None:
    """Register every module's own shards again after a step failed part-way (local, no
    communication), so that :func:`local_piece` can read a model about to be dropped.

    A step that failed between forward and backward, or inside the forward, leaves the
    gathered (full) parameters registered, and then the optimizer's (sharded) parameters
    are not the model's. Inside the forward FSDP's own ``reshard()`` keeps the root's
    gathered parameters (the root does not reshard after forward by default), so every
    module is told to reshard after forward first: the model trains differently from
    then on, which is why this is only for one that is dropped.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(True, recurse=False)
            module.reshard()


def build_unfilled(build: Callable[[], Any]) -> Any | None:
    """``build()`` on the meta device: a state whose every value is about to come from the
    pieces, without initializing the whole model on every rank first (at 100M parameters
    that is 0.4 GB and a third of a second per rank, all of it overwritten).

    None where a meta build cannot stand in for the real one, and the caller builds for
    real: the build failed on meta (it moved the model to a GPU, or read a value), or it
    left a tensor that :func:`materialize` would not reach (one made on a device of its
    own, one held in a plain attribute rather than as a parameter or buffer, an optimizer
    hyperparameter or state made at construction).
    """
    try:
        with torch.device("meta"):
            state = build()
    except Exception:  # the real build runs next and raises what is the user's to fix
        logger.debug("build() cannot run on the meta device; building for real",
                     exc_info=True)
        return None
    model, optimizer = getattr(state, "model", None), getattr(state, "optimizer", None)
    if not isinstance(model, torch.nn.Module) or not _all_on_meta(model) \
            or not isinstance(optimizer, torch.optim.Optimizer) or optimizer.state \
            or any(isinstance(v, torch.Tensor) for group in optimizer.param_groups
                   for k, v in group.items() if k != "params"):
        return None
    return state


def _all_on_meta(model: torch.nn.Module) -> bool:
    """Every parameter and buffer on meta, and no other tensor attribute of a module."""
    if not all(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return False
    for module in model.modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers"):
                continue
            items = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else (value,)
            if any(isinstance(item, torch.Tensor) for item in items):
                return False
    return True


def materialize(state: TrainState) -> None:
    """Memory for a meta-built state's tensors (after sharding: this rank's shards only),
    left uninitialized, on the device its factories would have used; nothing for a state
    built for real.

    The optimizer's state tensors are made on meta first (its own step, run with nothing to
    compute), then given memory the same way: a real first step would cost a pass over
    the state and a gradient's worth of zeros, only to be overwritten. An optimizer that
    cannot step on meta is left without state, for ``initialize_optimizer_state`` to make.
    """
    model, optimizer = state.model, state.optimizer
    if not any(p.is_meta for p in model.parameters()):
        return
    try:
        initialize_optimizer_state(optimizer)
    except Exception:  # e.g. it reads a value: made for real once the model has memory
        logger.debug("the optimizer cannot step on meta", exc_info=True)
        optimizer.state.clear()
    names = {id(p): name for name, p in model.named_parameters()}
    made = {names[id(p)]: entry for p, entry in optimizer.state.items()}
    device = torch.get_default_device()
    model.to_empty(device=device)
    # Unsharded parameters are replaced, not filled in place: the optimizer's groups and its
    # state (keyed by parameter) follow them by name. (FSDP's DTensors keep their identity.)
    _repoint(state, names)
    now = dict(model.named_parameters())
    optimizer.state.clear()
    for name, entry in made.items():
        optimizer.state[now[name]] = {
            key: _empty_like(value, device)
            if isinstance(value, torch.Tensor) and value.is_meta else value
            for key, value in entry.items()}


def _empty_like(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor on ``device`` for a meta one (a DTensor's local shard only)."""
    if isinstance(value, DTensor):
        return DTensor.from_local(torch.empty_like(value.to_local(), device=device),
                                  value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return torch.empty_like(value, device=device)


def local_piece(state: TrainState) -> Piece:
    """This rank's piece of model and optimizer state, as detached CPU tensors.

    Reads only local shards: safe after the round's groups are destroyed. The model's
    registered parameters must be its shards: between steps they are; after a failed
    step call :func:`put_shards_back` first.
    """
    model, optimizer = state.model, state.optimizer
    names = {id(p): name for name, p in model.named_parameters()}
    piece: Piece = {"params": {}, "optim_rows": {}, "optim_whole": {}, "groups": []}
    for name, param in model.named_parameters():
        piece["params"][name] = _local(param)
    piece["buffers"] = {name: _local(b) for name, b in model.named_buffers()}
    for held, entry in optimizer.state.items():
        name = names[id(held)]
        for key, value in entry.items():
            is_rows = isinstance(value, torch.Tensor) and value.shape == held.shape
            side = "optim_rows" if is_rows else "optim_whole"
            piece[side][f"{name}\0{key}"] = _local(value) if isinstance(value, torch.Tensor) \
                else value
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        piece["groups"].append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    return piece


def row_targets(state: TrainState) -> list[tuple[RowSpec, torch.Tensor]]:
    """Every row-cut tensor of ``state`` (parameters, and optimizer tensors shaped like their
    parameter) with its full shape, in one order every rank agrees on, and this rank's local
    tensor of it (its rows; the whole tensor when not sharded) to restore into. The
    optimizer's state tensors must exist (``initialize_optimizer_state``)."""
    model, optimizer = state.model, state.optimizer
    names = {id(p): name for name, p in model.named_parameters()}
    found = [(RowSpec("params", name, tuple(p.shape), p.dtype), _local(p, detach=False))
             for name, p in model.named_parameters()]
    for held, entry in optimizer.state.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == held.shape:
                found.append((RowSpec("optim_rows", f"{names[id(held)]}\0{key}",
                                      tuple(value.shape), value.dtype),
                              _local(value, detach=False)))
    return sorted(found, key=lambda pair: (pair[0].side, pair[0].key))


def load_whole(state: TrainState, whole: Piece) -> None:
    """Put what is whole on every rank (buffers, optimizer step counts and the like,
    hyperparameters) from ``whole`` into ``state``; the rows came with
    ``row_fetch.fetch_rows``. The optimizer's state tensors must exist."""
    model, optimizer = state.model, state.optimizer
    names = {id(p): name for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            _local(buffer, detach=False).copy_(whole["buffers"][name])
        for held, entry in optimizer.state.items():
            name = names[id(held)]
            for key, value in entry.items():
                flat = f"{name}\0{key}"
                if flat not in whole["optim_whole"]:
                    continue  # a row-cut tensor
                if isinstance(value, torch.Tensor):
                    value.copy_(whole["optim_whole"][flat])
                else:
                    entry[key] = whole["optim_whole"][flat]
    for group, saved in zip(optimizer.param_groups, whole["groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _local(tensor: torch.Tensor, *, detach: bool = True) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().cpu() if detach else local
