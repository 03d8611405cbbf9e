"""Pipeline and tensor parallelism the runtime builds: describe the model once. Run it with

    elastic-rt launch --nnodes 1:2 --nproc-per-node 2 scripts/examples/described_train.py

A small decoder (token and position embedding, pre-norm blocks of causal self-attention and
an MLP, a final norm and a head) learns the next character of a Python standard-library
source file, which every machine has. ``describe`` is all the parallelism the script
writes: which modules come before the repeated blocks, the blocks, which come after, a
tensor-parallel plan for one block in torch's own vocabulary, the loss and the optimizer.

Every round the runtime plans the layout from ``LIMITS`` (the model must be cut at least
``--min-cut`` ways), cuts the blocks into pipeline stages balanced by parameter count, runs
torch's schedule (``--schedule``), splits each block by the plan when the layout has
``tp > 1``, and averages gradients over the data-parallel replicas. When a node dies the
survivors re-plan (``dp2 x pp2`` -> ``pp3``...) and move the state by parameter name to the
new cut; see docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import elastic_rt as ert

VOCAB = 128  # ASCII


class Embed(nn.Module):
    def __init__(self, width: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(seq, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Attention(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv = (nn.Linear(width, width) for _ in range(3))
        self.wo = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv give this rank's heads only
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, head_dim)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, *, width: int, depth: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = Embed(width, seq)
        self.layers = nn.ModuleList(Block(width, width // heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def next_char_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


# Megatron's split of a block: q, k, v and up by columns (heads), wo and down by rows.
BLOCK_TP_PLAN = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                 "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                 "up": ColwiseParallel(), "down": RowwiseParallel()}


def describe(*, width: int = 32, depth: int = 4, heads: int = 4, seq: int = 16,
             lr: float = 3e-3, dtype: torch.dtype = torch.float32) -> ert.ModelDescription:
    """The model, described once; every rank builds the same one (seeded)."""
    torch.manual_seed(0)
    model = Decoder(width=width, depth=depth, heads=heads, seq=seq).to(dtype)
    return ert.ModelDescription(
        model=model, before=(model.embed,), blocks=model.layers, after=(model.norm, model.head),
        block_tp_plan=BLOCK_TP_PLAN, loss=next_char_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
    )


class CharWindows(torch.utils.data.Dataset):
    """Windows of ``seq`` characters of a standard-library source file and the next ones."""

    def __init__(self, seq: int, n: int) -> None:
        with open(os.__file__, encoding="utf-8") as f:
            text = torch.tensor([min(ord(c), VOCAB - 1) for c in f.read()])
        self.seq, self.text, self.n = seq, text, min(n, (len(text) - 1) // seq)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq
        return self.text[start:start + self.seq], self.text[start + 1:start + self.seq + 1]


def limits(n_params: int, args: argparse.Namespace) -> ert.ModelLimits:
    """The model does not fit a rank whole: it must be cut at least ``--min-cut`` ways."""
    return ert.ModelLimits(max_pp=args.max_pp, tp_options=tuple(args.tp_options),
                           n_params=n_params,
                           max_params_per_rank=math.ceil(n_params / args.min_cut))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="train this many steps")
    p.add_argument("--global-batch", type=int, default=12, help="sequences per step")
    p.add_argument("--samples", type=int, default=2400, help="windows of the text")
    p.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B (or Interleaved1F1B)")
    p.add_argument("--max-pp", type=int, default=4, help="most pipeline stages")
    p.add_argument("--tp-options", type=int, nargs="+", default=[1, 2], help="tp degrees")
    p.add_argument("--min-cut", type=int, default=2, help="pp x tp must be at least this")
    p.add_argument("--float64", action="store_true", help="train in float64")
    p.add_argument("--checkpoint", default=None, help="checkpoint URL (path, file://, s3://)")
    p.add_argument("--every", type=int, default=50, help="checkpoint every this many steps")
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step (s)")
    p.add_argument("--out", default=None, help="folder: each rank writes its parameters there")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dtype = torch.float64 if args.float64 else torch.float32
    n_params = sum(p.numel() for p in describe(dtype=dtype).model.parameters())

    def build(layout: ert.Layout) -> ert.ModelDescription:
        return describe(dtype=dtype)  # the same model for every layout: the runtime cuts it

    def report(step: ert.StepReport) -> None:
        if args.step_time:
            time.sleep(args.step_time)  # simulated compute, so a test can kill mid-run
        if ert.context().rank == 0 and step.step % 20 == 0:
            print(f"step {step.step} loss {step.loss:.4f} layout {ert.context().layout}",
                  flush=True)

    checkpoint = None
    if args.checkpoint:
        # by the whole model's parameter names: it loads into any pp x tp cut
        checkpoint = ert.Checkpointer(args.checkpoint, every_steps=args.every)
    state = ert.run(
        build=build,
        step=None,  # the loss is the description's: the runtime runs the pipeline
        model_parallel=ert.ModelParallel(schedule=args.schedule),
        dataset=CharWindows(16, args.samples),
        global_batch_size=args.global_batch,
        max_steps=args.steps,
        limits=limits(n_params, args),
        checkpoint=checkpoint,
        on_step=report,
    )
    if args.out:
        # Stages keep the whole model's names, so the files together are the model.
        os.makedirs(args.out, exist_ok=True)
        params = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                  for name, p in state.model.named_parameters()}
        torch.save(params, os.path.join(args.out, f"rank-{ert.context().rank}.pt"))


if __name__ == "__main__":
    main()
