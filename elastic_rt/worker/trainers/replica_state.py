"""A replicated ``TrainState`` as a restore moves it: its tensors in one order, and the rest.

Rule: the tensors are the model's state_dict in its own order, then the optimizer's state by
``param_groups`` order and sorted keys; everything else is one small :class:`Outline` (a few
KB: hyperparameters, non-tensor optimizer state, the ``TrainMeta``), the only part pickled::

    holder:   named_tensors(state) -> Outline.of(state, meta)     (broadcast by holder 0)
    receiver: receive_into(state, outline) -> [transfer in place]

Every rank built the same model and optimizer, so the order is the same everywhere. A
receiver's optimizer state is allocated from the outline, empty, and loaded with the
holders' non-tensor part before any byte arrives, so each tensor is received into the
tensor the optimizer then keeps. Not created by running the optimizer's step at lr 0
(``initialize_optimizer_state``, which a checkpoint load needs): that step reads and
writes every parameter and moment (0.3 s of a 400 MB AdamW state here) while the members
wait. A tensor a receiver lacks or holds in another shape or dtype is a
:class:`ReplicaMismatchError` naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from elastic_rt.errors import ReplicaMismatchError
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.meta import TrainMeta

logger = logging.getLogger(__name__)

Signature = tuple[tuple[str, tuple[int, ...], str], ...]
"""(name, shape, dtype) of every tensor, in transfer order."""


@dataclass(frozen=True, slots=True)
class Outline:
    """What a receiver needs besides the tensors' bytes, from holder 0."""

    meta: dict[str, Any]
    """``TrainMeta.encode()`` of the holders' step."""
    param_groups: list[dict[str, Any]]
    """The optimizer's ``param_groups`` as its ``state_dict`` gives them."""
    plain: dict[int, dict[str, Any]]
    """The optimizer's non-tensor state values, by parameter index."""
    model_extra: dict[str, Any]
    """Non-tensor entries of the model's state_dict (``get_extra_state``)."""
    signature: Signature
    devices: tuple[str, ...]
    """The device type each tensor is kept on (e.g. AdamW's ``step`` counts on the host
    while the moments are on the GPU), in signature order."""

    @classmethod
    def of(cls, state: TrainState, meta: TrainMeta) -> Outline:
        named = named_tensors(state)
        plain = {i: {k: v for k, v in state.optimizer.state[p].items()
                     if not isinstance(v, torch.Tensor)}
                 for i, p in enumerate(_params(state.optimizer)) if p in state.optimizer.state}
        extra = {k: v for k, v in state.model.state_dict().items()
                 if not isinstance(v, torch.Tensor)}
        return cls(meta=meta.encode(),
                   param_groups=state.optimizer.state_dict()["param_groups"],
                   plain={i: values for i, values in plain.items() if values},
                   model_extra=extra,
                   signature=tuple((n, tuple(t.shape), str(t.dtype)) for n, t in named),
                   devices=tuple(t.device.type for _, t in named))


def named_tensors(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the state, in the order every rank computes alike: the model's
    parameters and buffers and the optimizer's tensors themselves, not aliases (writing
    into one writes the state; a receive that broke gives one new memory,
    ``replica_transfer``)."""
    named = [(f"model.{k}", v) for k, v in state.model.state_dict(keep_vars=True).items()
             if isinstance(v, torch.Tensor)]
    for index, param in enumerate(_params(state.optimizer)):
        values = state.optimizer.state.get(param, {})
        named.extend((f"optimizer.{index}.{key}", values[key]) for key in sorted(values)
                     if isinstance(values[key], torch.Tensor))
    return named


def receive_into(state: TrainState, outline: Outline) -> list[torch.Tensor]:
    """A receiver's tensors in the holders' order, ready to be written: its optimizer state
    allocated (uninitialized; a rank that fell behind keeps its own tensors) and loaded
    with the holders' non-tensor part first.

    Raises:
        ReplicaMismatchError: the holders' optimizer or model differs from this rank's (a
            tensor missing here, or of another shape or dtype).
    """
    params = _params(state.optimizer)
    by_param: dict[int, dict[str, Any]] = {i: dict(v) for i, v in outline.plain.items()}
    for (name, shape, dtype), kind in zip(outline.signature, outline.devices):
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            if int(index) >= len(params):
                raise _mismatch(name, shape, dtype, None)
            param = params[int(index)]
            kept = state.optimizer.state.get(param, {}).get(key)  # a rank that fell behind
            if not (isinstance(kept, torch.Tensor) and kept.device.type == kind
                    and (tuple(kept.shape), str(kept.dtype)) == (shape, dtype)):
                kept = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                                   device=param.device if param.device.type == kind
                                   else torch.device(kind))
            by_param.setdefault(int(index), {})[key] = kept
    try:  # keeps tensors of the parameter's dtype and device as they are: no copy
        state.optimizer.load_state_dict({"state": by_param,
                                         "param_groups": outline.param_groups})
    except ValueError as exc:  # torch's word for groups of other sizes
        raise ReplicaMismatchError(
            f"the replica's optimizer differs from the holders': {exc}",
            "Make build(layout) return the same model and optimizer on every rank.") from exc
    if outline.model_extra:
        state.model.load_state_dict({**state.model.state_dict(), **outline.model_extra})
    own = dict(named_tensors(state))
    tensors = []
    for name, shape, dtype in outline.signature:
        tensor = own.get(name)
        if tensor is None or (tuple(tensor.shape), str(tensor.dtype)) != (shape, dtype):
            raise _mismatch(name, shape, dtype, tensor)
        tensors.append(tensor)
    return tensors


def staging_for(outline: Outline) -> list[torch.Tensor] | None:
    """Fresh tensors for every tensor of ``outline``, for a receiver that keeps its own
    state until the stream has landed (one more state in memory, on that rank, for one
    step); None where the memory is not there, and the receiver writes its own tensors."""
    try:
        return [torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                            device=torch.device(kind))  # cuda: the current device
                for (_, shape, dtype), kind in zip(outline.signature, outline.devices)]
    except (MemoryError, torch.OutOfMemoryError):
        logger.warning("no memory to keep this rank's own state while the newer one "
                       "arrives; receiving into it")
        return None


def _mismatch(name: str, shape: tuple[int, ...], dtype: str,
              tensor: torch.Tensor | None) -> ReplicaMismatchError:
    here = "none" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
    return ReplicaMismatchError(
        f"the replica's {name} is {shape} {dtype} on the ranks holding the state "
        f"but {here} on this rank",
        "Make build(layout) return the same model and optimizer on every rank.")


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the numbering of ``optimizer.state_dict()`` (group by group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]
