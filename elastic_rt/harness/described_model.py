"""A small transformer-ish model described once for the runtime-parallel family.

Shared by ``scripts/examples/described_train.py`` and the tests that check the family
against :func:`reference_params` (one process, the same global batches), so it lives here,
where both import it by one name.

The model maps a sequence of feature vectors to targets: ``embed`` (a linear projection),
``depth`` pre-norm blocks (a gated mixer across positions and a feed-forward pair, the pair
Megatron splits column- then row-wise), ``norm`` and ``head``. Seeded, so every rank builds
the same model. :func:`describe` is the whole of what a user writes for pp x tp x dp; with
``sequence_parallel`` its plans keep the activations cut along the sequence between the
tensor-parallel ranks (Megatron's sequence parallelism, in torch's plan vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils.data import default_collate

from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.trainers.runtime_parallel.description import ModelDescription

FEATURES, SEQ = 6, 4


class CausalMix(nn.Linear):
    """Each position a learned mix of itself and the positions before it: ``(b, t, w)`` in
    and out (a ``SEQ x SEQ`` weight, lower triangle used)."""

    def __init__(self) -> None:
        super().__init__(SEQ, SEQ, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.tril(torch.ones(SEQ, SEQ, dtype=x.dtype, device=x.device))
        return torch.einsum("ts,bsw->btw", self.weight * mask, x)


class Block(nn.Module):
    """Pre-norm residual block: a causal mix over positions, then a feed-forward pair."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = CausalMix()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm(x))
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


BLOCK_PLAN: dict[str, ParallelStyle] = {"up": ColwiseParallel(), "down": RowwiseParallel()}
"""Activations replicated on the tensor-parallel ranks; the outer modules too."""

_SLICE, _WHOLE = (Shard(1),), (Replicate(),)  # of the sequence
SEQUENCE_BLOCK_PLAN: dict[str, ParallelStyle] = {
    "norm": SequenceParallel(),
    # the mix needs every position: gathered in, this rank's slice out
    "mix": PrepareModuleInputOutput(input_layouts=_SLICE, desired_input_layouts=_WHOLE,
                                    use_local_input=True, output_layouts=_WHOLE,
                                    desired_output_layouts=_SLICE),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(output_layouts=Shard(1)),
}
"""Sequence parallelism: between the blocks each tp rank holds its slice of the sequence."""
SEQUENCE_OUTER_PLAN: dict[str, ParallelStyle] = {
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "head": PrepareModuleInput(input_layouts=_SLICE, desired_input_layouts=_WHOLE,
                               use_local_output=True),
}
"""The embedding's output cut along the sequence; the head (one output) sees it whole."""


def describe(*, width: int = 8, depth: int = 4, lr: float = 0.05, seed: int = 0,
             dtype: torch.dtype = torch.float64,
             sequence_parallel: bool = False) -> ModelDescription:
    """The model, its blocks, its tensor-parallel plans, loss and optimizer."""
    torch.manual_seed(seed)
    model = Model(width, depth).to(dtype)
    return ModelDescription(
        model=model, before=(model.embed,), blocks=model.layers, after=(model.norm, model.head),
        block_tp_plan=SEQUENCE_BLOCK_PLAN if sequence_parallel else BLOCK_PLAN,
        outer_tp_plan=SEQUENCE_OUTER_PLAN if sequence_parallel else None,
        loss=mse, optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
    )


class Sequences(torch.utils.data.Dataset):
    """``(x, y)``: ``y`` a fixed nonlinear function of ``x``, deterministic by seed."""

    def __init__(self, n: int, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, SEQ, FEATURES, generator=generator).to(dtype)
        self.y = torch.tanh(self.x.cumsum(1).sum(-1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def reference_params(steps: int, *, samples: int, global_batch: int,
                     **model: Any) -> dict[str, torch.Tensor]:
    """The uninterrupted one-process run over the same global batches: its parameters."""
    return reference_state(steps, samples=samples, global_batch=global_batch, **model)[0]


def reference_state(steps: int, *, samples: int, global_batch: int, clip: float | None = None,
                    **model: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The one-process run's parameters and AdamW first moments (``exp_avg``), by name.

    The moments are the gradients' scale, which the parameters are not: Adam's update is
    nearly scale-free, so a layout that sums gradients ``dp`` times too small matches the
    parameters at 1e-5 and only the moments tell. ``clip``: ``clip_grad_norm_`` each step.
    """
    described = describe(**model)
    optimizer = described.optimizer(list(described.model.parameters()))
    data = Sequences(samples)
    sampler = ElasticSampler(samples, global_batch_size=global_batch, seed=0)
    for _ in range(steps):
        x, y = default_collate([data[i] for i in sampler.global_batch()])
        optimizer.zero_grad()
        described.loss(described.model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(described.model.parameters(), clip)
        optimizer.step()
        sampler.advance()
    named = list(described.model.named_parameters())
    return ({name: p.detach().clone() for name, p in named},
            {name: optimizer.state[p]["exp_avg"].clone() for name, p in named
             if p in optimizer.state})
