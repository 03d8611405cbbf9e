"""One small model, trained under any layout: data, pipeline, tensor parallel and their hybrids.

Shared by the examples (``scripts/examples/parallel_models.py``, ``pipeline_train.py``) and the
tests that check resharding and model-parallel recovery against it, so it lives here, where
both import it by one name.

The model is a stack of residual MLP blocks (``x + down(relu(up(x)))``). Every layout trains the
same math as :class:`ReferenceTrainer`, the plain single-process loop, so a run can change its
layout half-way (after a node loss, restored from a checkpoint) and still end where it would
have ended without the change.

``build(layout, groups)`` returns this rank's piece as a trainer with ``step((x, y))``,
``predict(x)``, ``state_dict()`` and ``load_state_dict(state)``:

- ``dp`` only: the whole model under ``DistributedDataParallel``.
- ``dp`` sharded (``fsdp4``, ``hsdp2x2``): the whole model under FSDP2 ``fully_shard``, one
  unit per block, over the round's shard mesh; gradients summed by its reduce-scatter.
- anything with ``pp`` or ``tp``: this rank's pipeline stage (a contiguous run of blocks),
  tensor-split with DTensor when ``tp > 1``, activations passed between stages with plain
  ``send``/``recv`` in a GPipe schedule, gradients summed over the ``dp`` group by hand.

Two choices make checkpoints portable between layouts:

- A stage keeps the full model's names: stage 1 of 2 holds ``blocks.2`` and ``blocks.3``, not
  ``0`` and ``1``, so a checkpoint written under ``pp2`` loads into ``pp1`` by name.
- ``state_dict()`` comes from ``torch.distributed.checkpoint.state_dict`` with the optimizer
  state flattened per parameter name (``state.blocks.2.up.weight.momentum_buffer``), so the
  optimizer state reshards exactly like the parameters. Tensor-parallel entries are DTensors,
  which DCP reassembles into whatever shape the loading layout asks for.

The trainers take the *global* batch and slice their own rows; the loss is a sum over rows
divided by the global batch size, so the gradient does not depend on how rows are split.
``step_share(share, global_batch)`` trains on rows already split out (the elastic loop hands each
data-parallel rank its share; see ``pipeline_train.py``). Every collective of a step comes before
its optimizer update (``is_step_atomic``): a step that raises because a peer died has changed no
parameter or optimizer state, so an elastic loop may restore other ranks from this one.

Train it with ``scripts/examples/parallel_models.py`` (under torchrun, any layout, resuming
from a checkpoint of another).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from elastic_rt.layout import Layout, ModelLimits
from elastic_rt.process_groups import Groups

WIDTH = 8
DEPTH = 4
# How this model may be split: at least one block per stage; tp must divide both widths.
LIMITS = ModelLimits(max_pp=DEPTH, tp_options=(1, 2, 4))
_STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
Batch = tuple[torch.Tensor, torch.Tensor]
"""A global batch: inputs and targets, every rank holding all of it."""


class Block(nn.Module):
    """A residual MLP block; ``up``/``down`` is the pair Megatron splits column- then row-wise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MLP(nn.Module):
    """The model, or the part of it holding ``blocks`` (a pipeline stage), under the full names.

    Each block is initialised from its own generator, seeded by ``(seed, block index)``, so a
    stage gets the same weights as the same blocks of the whole model without building it.
    """

    def __init__(self, *, width: int = WIDTH, depth: int = DEPTH, seed: int = 0,
                 blocks: Iterable[int] | None = None) -> None:
        super().__init__()
        ids = range(depth) if blocks is None else blocks
        self.blocks = nn.ModuleDict({str(i): _seeded_block(width, seed, i) for i in ids})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def _seeded_block(width: int, seed: int, index: int) -> Block:
    block = Block(width)
    generator = torch.Generator().manual_seed(seed * 10_007 + index)
    with torch.no_grad():
        for linear in (block.up, block.down):
            bound = 1 / math.sqrt(linear.in_features)
            for param in (linear.weight, linear.bias):
                param.uniform_(-bound, bound, generator=generator)
    return block


def stage_blocks(depth: int, pp: int, stage: int) -> range:
    """The blocks of pipeline ``stage`` of ``pp``: contiguous, sizes differing by at most one."""
    return range(stage * depth // pp, (stage + 1) * depth // pp)


def make_batch(step: int, *, global_batch: int = 12, width: int = WIDTH, seed: int = 0) -> Batch:
    """The global batch of ``step``: the same on every rank and in every layout."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(global_batch, width, generator=generator)
    return x, torch.sin(x)


class Pairs(torch.utils.data.Dataset):
    """``(x, sin(x))`` rows: deterministic, so a reference run sees the same data."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.x = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed))
        self.y = torch.sin(self.x)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loss_fn(out: torch.Tensor, target: torch.Tensor, global_batch: int) -> torch.Tensor:
    """Summed squared error over this piece's rows, divided by the *global* batch size.

    Summing the pieces' losses (and so their gradients) gives the full batch's mean loss,
    whatever the split.
    """
    return ((out - target) ** 2).sum() / global_batch


def make_optimizer(model: nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    """SGD with momentum: its state (one buffer per parameter) reshards like the parameters."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


class Trainer(Protocol):
    """What ``build`` returns: one rank's piece of the model, trainable on a global batch."""

    def step(self, batch: Batch) -> float: ...

    def step_share(self, share: Batch, global_batch: int) -> float: ...

    def predict(self, x: torch.Tensor) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def full_params(self) -> dict[str, torch.Tensor]: ...


class _Trainable:
    """State handling every trainer shares: model + optimizer through DCP's state-dict helpers.

    ``is_step_atomic``: a step that raises has applied no update (see the module docstring).

    ``state_dict()`` hands out the live tensors (a checkpoint load fills them in place);
    ``load_state_dict()`` may keep the tensors it is given, so give it a copy you won't reuse.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    is_step_atomic = True

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer, options=_STATE_OPTIONS)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_STATE_OPTIONS)

    def full_params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by full name, tensor-parallel shards gathered (collective)."""
        model = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        return {name: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach().clone()
                for name, p in model.named_parameters()}


class ReferenceTrainer(_Trainable):
    """The plain single-process loop every layout must match."""

    def __init__(self, *, seed: int = 0, lr: float = 0.05) -> None:
        self.model = MLP(seed=seed)
        self.optimizer = make_optimizer(self.model, lr)

    def step(self, batch: Batch) -> float:
        x, y = batch
        loss = loss_fn(self.model(x), y, len(x))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _DataParallel(_Trainable):
    """A trainer of the whole model on each data-parallel rank: its rows of every batch."""

    dp_rank: int
    dp: int
    group: dist.ProcessGroup
    grad_scale = 1
    """What the loss is multiplied by before backward, so that the reduction sums."""

    def step(self, batch: Batch) -> float:
        x, y = batch
        rows = _my_rows(len(x), self.dp_rank, self.dp)
        return self.step_share((x[rows], y[rows]), len(x))

    def step_share(self, share: Batch, global_batch: int) -> float:
        """One step on this rank's rows of a global batch of ``global_batch`` rows."""
        x, y = share
        loss = loss_fn(self.model(x), y, global_batch)
        (loss * self.grad_scale).backward()
        total = _sum(loss.detach(), self.group)  # before the update: see ``is_step_atomic``
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total


class DDPTrainer(_DataParallel):
    """Pure data parallelism: the whole model on every rank, gradients averaged by DDP."""

    def __init__(self, layout: Layout, groups: Groups, *, seed: int = 0, lr: float = 0.05) -> None:
        self.dp_rank, self.dp, self.group = layout.coords(groups.rank).dp, layout.dp, groups.dp
        # DDP averages gradients over dp; scaling by dp turns that average into the sum we want.
        self.grad_scale = self.dp
        # Same seed on every rank, so there is nothing to broadcast (DDP checks that anyway).
        self.model = DistributedDataParallel(MLP(seed=seed), process_group=groups.dp)
        self.optimizer = make_optimizer(self.model, lr)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        module: torch.nn.Module = self.model.module  # type: ignore[assignment]
        return module(x)


class FSDPTrainer(_DataParallel):
    """Sharded data parallelism: each rank holds its rows of every parameter, gradient and
    momentum buffer (FSDP), or of one replica's (HSDP: ``groups.shard_mesh`` is 2-D)."""

    def __init__(self, layout: Layout, groups: Groups, *, seed: int = 0, lr: float = 0.05) -> None:
        self.dp_rank, self.dp, self.group = layout.coords(groups.rank).dp, layout.dp, groups.dp
        model = MLP(seed=seed)  # the same on every rank, so each keeps its own rows
        for block in model.blocks.values():
            fully_shard(block, mesh=groups.shard_mesh)
        fully_shard(model, mesh=groups.shard_mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Sum, not average: the loss is already divided by the global batch size.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        self.model = model
        self.optimizer = make_optimizer(self.model, lr)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for ``x``; collective (every rank gathers each block's rows)."""
        return self.model(x)


class MeshTrainer(_Trainable):
    """Any ``pp x dp x tp`` layout: this rank's stage, tensor-split, in a GPipe schedule.

    Activations and their gradients go between neighbouring stages of one replica over the
    ``pp`` group; each tensor-parallel rank talks to the same ``tp`` rank of the next stage.
    """

    def __init__(self, layout: Layout, groups: Groups, *, seed: int = 0, lr: float = 0.05,
                 n_micro: int = 2) -> None:
        self.layout, self.groups, self.n_micro = layout, groups, n_micro
        self.coords = layout.coords(groups.rank)
        self.is_first, self.is_last = self.coords.pp == 0, self.coords.pp == layout.pp - 1
        blocks = stage_blocks(DEPTH, layout.pp, self.coords.pp)
        self.model = MLP(seed=seed, blocks=blocks)
        if layout.tp > 1:
            _split_tensors(self.model, blocks, groups)
        self.optimizer = make_optimizer(self.model, lr)

    def step(self, batch: Batch) -> float:
        x, y = batch
        rows = _my_rows(len(x), self.coords.dp, self.layout.dp)
        return self.step_share((x[rows], y[rows]), len(x))

    def step_share(self, share: Batch, global_batch: int) -> float:
        """One step on this replica's rows of a global batch of ``global_batch`` rows.

        Every stage of the replica gets the same rows: the first uses ``x``, the last ``y``.
        """
        x, y = share
        # Never an empty micro-batch; every stage of the replica computes the same split.
        n_micro = max(1, min(self.n_micro, len(x)))
        micro = zip(torch.tensor_split(x, n_micro), torch.tensor_split(y, n_micro))
        # GPipe: every micro-batch forward, then every one backward (in reverse order).
        inputs, outputs = zip(*[self._forward(mx, my, global_batch) for mx, my in micro])
        for inp, out in zip(reversed(inputs), reversed(outputs)):
            self._backward(inp, out)
        self._sum_grads_over_dp()
        # Only the last stage has a loss, and its tp ranks all hold the same one: count it once.
        mine = sum(o.detach() for o in outputs) if self.is_last and self.coords.tp == 0 else 0.0
        total = _sum(torch.as_tensor(mine), self.groups.world)  # before the update, as in DDP
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for ``x`` (the whole input, no micro-batches), on every rank."""
        out = self.model(x if self.is_first else self._recv(x.shape, self.coords.pp - 1))
        if not self.is_last:
            self._send(out, self.coords.pp + 1)
            out = torch.empty_like(x)
        dist.broadcast(out, group=self.groups.pp, group_src=self.layout.pp - 1)
        return out

    def _forward(self, x: torch.Tensor, y: torch.Tensor,
                 global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch through this stage: (its input, the loss or the activation sent on)."""
        inp = x if self.is_first else self._recv(x.shape, self.coords.pp - 1).requires_grad_()
        out = self.model(inp)
        if self.is_last:
            return inp, loss_fn(out, y, global_batch)
        self._send(out.detach(), self.coords.pp + 1)
        return inp, out

    def _backward(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        if self.is_last:
            out.backward()
        else:
            out.backward(self._recv(out.shape, self.coords.pp + 1))
        if not self.is_first:
            assert inp.grad is not None, "the stage input requires grad"
            self._send(inp.grad, self.coords.pp - 1)

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        dist.send(tensor.contiguous(), group=self.groups.pp, group_dst=stage)

    def _recv(self, shape: torch.Size, stage: int) -> torch.Tensor:
        tensor = torch.empty(shape)
        dist.recv(tensor, group=self.groups.pp, group_src=stage)
        return tensor

    @torch.no_grad()
    def _sum_grads_over_dp(self) -> None:
        # By hand instead of DDP, which cannot see gradients that arrive over send/recv.
        # One allreduce per parameter is fine for a model this small; real code buckets them.
        if self.layout.dp == 1:
            return
        for param in self.model.parameters():
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=self.groups.dp)


def _split_tensors(model: MLP, blocks: range, groups: Groups) -> None:
    """Megatron-style tensor parallelism: ``up`` split by output column, ``down`` by input row.

    The pair needs one allreduce per block (after ``down``), and every block's input and
    output stay whole, so the pipeline passes plain tensors between stages.
    """
    if groups.mesh is None:
        raise ValueError(f"tensor parallelism needs the round's DeviceMesh ({groups.layout})")
    plan: dict[str, ParallelStyle] = {}
    for i in blocks:
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    # src_data_rank=None: every rank built identical weights from the seed, so each keeps its
    # own shard instead of receiving it from rank 0.
    parallelize_module(model, groups.mesh["tp"], plan, src_data_rank=None)


def build(layout: Layout, groups: Groups, *, seed: int = 0, lr: float = 0.05) -> Trainer:
    """This rank's piece of the model for ``layout``: DDP when the layout is pure dp."""
    if layout.shard > 1:
        return FSDPTrainer(layout, groups, seed=seed, lr=lr)
    if layout.pp == 1 and layout.tp == 1:
        return DDPTrainer(layout, groups, seed=seed, lr=lr)
    return MeshTrainer(layout, groups, seed=seed, lr=lr)


def _my_rows(n: int, dp_rank: int, dp: int) -> slice:
    return slice(dp_rank * n // dp, (dp_rank + 1) * n // dp)


def _sum(value: torch.Tensor, group: dist.ProcessGroup) -> float:
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value.item()


def parse_layout(text: str) -> Layout:
    """``"dp2xpp2"`` -> ``Layout(dp=2, pp=2)``; axes left out are 1. ``"fsdp4"`` shards dp4;
    ``"hsdp2x2"`` is 2 replicas of 2 shards (``Layout(dp=4, shard=2)``)."""
    sharded = re.fullmatch(r"fsdp(\d+)|hsdp(\d+)x(\d+)", text)
    if sharded:
        replicas, shard = (1, int(sharded[1])) if sharded[1] else (int(sharded[2]),
                                                                   int(sharded[3]))
        return Layout(dp=replicas * shard, shard=shard)
    degrees = {axis: int(n) for axis, n in re.findall(r"(dp|pp|tp)(\d+)", text)}
    return Layout(dp=degrees.get("dp", 1), pp=degrees.get("pp", 1), tp=degrees.get("tp", 1))
