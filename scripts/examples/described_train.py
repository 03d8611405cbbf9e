"""Pipeline, tensor and FSDP parallelism the runtime builds: describe the model once. Run it with

    elastic-rt launch --nnodes 1:2 --nproc-per-node 2 scripts/examples/described_train.py

A small Llama-style decoder (token embedding, pre-norm blocks of causal self-attention with
rotary positions and a SwiGLU MLP, RMSNorm, no biases; 3,205,376 parameters at the default
``--width 256 --depth 4 --heads 8``) learns the next character of the Python standard
library's own source files (``corpus``), which every machine has. ``describe`` is all the
parallelism the script writes: which modules come before the repeated blocks, the blocks,
which come after, a tensor-parallel plan for one block in torch's own vocabulary, the loss
and the optimizer.

Every round the runtime plans the layout from ``limits`` (the model must be cut at least
``--min-cut`` ways, pipeline stages x tensor shards x FSDP shards), cuts the blocks into
pipeline stages balanced by parameter count, runs torch's schedule (``--schedule``), splits
each block by the plan when the layout has ``tp > 1``, shards each part over its
data-parallel ranks with FSDP2 when ``--max-shard`` allows, and averages gradients over the
data-parallel replicas. When a node dies the survivors re-plan (``dp2 x pp2`` -> ``pp3``...)
and move the state by parameter name to the new cut; see docs/parallelism.md.

Measured on this 2-core machine (CPU, float32, global batch 16 x 64 characters, 200 steps,
load average ~3.5 from other jobs) with ``elastic-rt launch --nnodes 1 --nproc-per-node N
scripts/examples/described_train.py FLAGS``; the loss is the step's global batch's::

    N  FLAGS                      layout        loss at step 1    5     20    100   200   s/step
    2  (none)                     dp1xpp1xtp2            5.06  2.86  2.50  1.98  1.97   0.36
    2  --tp-options 1             dp1xpp2xtp1            5.06  2.86  2.50  1.98  1.97   0.31
    4  --max-shard 2 --min-cut 3  fsdp2xtp2              5.06  2.86  2.50  2.00  1.96   0.57

ln 128 = 4.85 is a uniform guess. (The ``pp2`` run's first loss, measured again after a fix
of the first pipelined step's report, on a quiet machine: 0.25 s a step.)
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import elastic_rt as ert
from elastic_rt.harness.pace import SimulatedCompute

VOCAB = 128  # ASCII
CORPUS_CHARS = 2_000_000  # 2 MB: CPython 3.11's first 74 source files by name (__future__ to io)


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate each head's ``(b, t, heads, head_dim)`` features by its position (RoPE).

    Per head, so it is the same whether ``x`` holds every head or, under tensor
    parallelism, this rank's heads only; computed here, not kept as a buffer, so stages
    and shards carry nothing but parameters.
    """
    t, half = x.shape[1], x.shape[-1] // 2
    freqs = 10000.0 ** -(torch.arange(half, dtype=x.dtype, device=x.device) / half)
    angles = torch.outer(torch.arange(t, dtype=x.dtype, device=x.device), freqs)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False)
                                              for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv give this rank's heads only
        q, k, v = (w(x).view(b, t, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k, v = (y.transpose(1, 2) for y in (rotary(q), rotary(k), v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        hidden = 8 * round(8 * width / 3 / 8)  # Llama's 8/3 width, a multiple of 8
        self.w1, self.w3, self.w2 = (nn.Linear(n_in, n_out, bias=False) for n_in, n_out
                                     in ((width, hidden), (width, hidden), (hidden, width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attention, self.feed_forward = Attention(width, head_dim), SwiGLU(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    """Llama's shape, small: token embedding (positions come from rotary), pre-norm blocks
    of rotary attention and a SwiGLU MLP, RMSNorm, no biases, a head."""

    def __init__(self, *, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(Block(width, width // heads) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def next_char_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


# Megatron's split of a block, as torchtitan writes it for Llama: q, k, v, w1 and w3 by
# columns (heads, hidden units), wo and w2 by rows.
BLOCK_TP_PLAN = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                 "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                 "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                 "feed_forward.w2": RowwiseParallel()}


# Sequence parallelism on top (Megatron's, as torchtitan plans it): between the blocks
# each tensor-parallel rank holds its slice of the sequence, so the norms and residual adds
# run on 1/tp of the positions; attention and the MLP gather the whole sequence on the way
# in, and wo and w2 reduce-scatter it back to slices on the way out.
_SLICE, _WHOLE = (Shard(1),), (Replicate(),)  # of the sequence
SEQUENCE_BLOCK_PLAN: dict[str, ParallelStyle] = {
    "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
    "attention": PrepareModuleInput(input_layouts=_SLICE, desired_input_layouts=_WHOLE,
                                    use_local_output=True),
    "feed_forward": PrepareModuleInput(input_layouts=_SLICE, desired_input_layouts=_WHOLE,
                                       use_local_output=True),
    **BLOCK_TP_PLAN,
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
}
SEQUENCE_OUTER_PLAN: dict[str, ParallelStyle] = {
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}


def describe(*, width: int = 256, depth: int = 4, heads: int = 8, lr: float = 3e-3,
             dtype: torch.dtype = torch.float32,
             sequence_parallel: bool = False) -> ert.ModelDescription:
    """The model, described once; every rank builds the same one (seeded)."""
    torch.manual_seed(0)
    model = Decoder(width=width, depth=depth, heads=heads).to(dtype)
    return ert.ModelDescription(
        model=model, before=(model.embed,), blocks=model.layers, after=(model.norm, model.head),
        block_tp_plan=SEQUENCE_BLOCK_PLAN if sequence_parallel else BLOCK_TP_PLAN,
        outer_tp_plan=SEQUENCE_OUTER_PLAN if sequence_parallel else None,
        loss=next_char_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
    )


def corpus(chars: int = CORPUS_CHARS) -> torch.Tensor:
    """The first ``chars`` characters of the standard library's own ``.py`` files (those
    beside ``os.py``, sorted by name), as ASCII codes: real text on every machine, with no
    download. A character outside ASCII becomes ``?``."""
    folder = os.path.dirname(os.__file__)
    parts, size = [], 0
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".py")):
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            parts.append(f.read().encode("ascii", errors="replace"))
        size += len(parts[-1])
        if size >= chars:
            break
    return torch.frombuffer(bytearray(b"".join(parts)[:chars]), dtype=torch.uint8).long()


class CharWindows(torch.utils.data.Dataset):
    """Windows of ``seq`` characters of :func:`corpus` and the next ones (the first ``n``
    windows; all of them without ``n``)."""

    def __init__(self, seq: int, n: int | None = None) -> None:
        self.seq, self.text = seq, corpus()
        windows = (len(self.text) - 1) // seq
        self.n = windows if n is None else min(n, windows)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq
        return self.text[start:start + self.seq], self.text[start + 1:start + self.seq + 1]


def limits(n_params: int, args: argparse.Namespace) -> ert.ModelLimits:
    """The model does not fit a rank whole: it must be cut at least ``--min-cut`` ways
    (pipeline stages x tensor shards x FSDP shards)."""
    return ert.ModelLimits(max_pp=args.max_pp, tp_options=tuple(args.tp_options),
                           max_shard=args.max_shard, n_params=n_params,
                           max_params_per_rank=math.ceil(n_params / args.min_cut))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="train this many steps")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    p.add_argument("--samples", type=int, default=None, help="windows of the text (all)")
    p.add_argument("--width", type=int, default=256, help="model width")
    p.add_argument("--depth", type=int, default=4, help="blocks")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--seq", type=int, default=64, help="characters per sequence")
    p.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B (or Interleaved1F1B)")
    p.add_argument("--max-pp", type=int, default=4, help="most pipeline stages")
    p.add_argument("--tp-options", type=int, nargs="+", default=[1, 2], help="tp degrees")
    p.add_argument("--max-shard", type=int, default=1,
                   help="most ranks one copy of each part is FSDP-sharded over")
    p.add_argument("--min-cut", type=int, default=2,
                   help="pp x tp x FSDP shards must be at least this")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="cut the activations along the sequence between tp ranks "
                        "(--seq a multiple of every tp option)")
    p.add_argument("--float64", action="store_true", help="train in float64")
    p.add_argument("--checkpoint", default=None, help="checkpoint URL (path, file://, s3://)")
    p.add_argument("--every", type=int, default=50, help="checkpoint every this many steps")
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step (s)")
    p.add_argument("--step-time-until", default=None, metavar="FILE",
                   help="simulate compute only until FILE exists (tests hold a slow pace so)")
    p.add_argument("--out", default=None, help="folder: each rank writes its parameters there")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dtype = torch.float64 if args.float64 else torch.float32
    sizes = {"width": args.width, "depth": args.depth, "heads": args.heads}
    n_params = sum(p.numel() for p in describe(**sizes, dtype=dtype).model.parameters())
    if any(args.seq % tp for tp in args.tp_options) and args.sequence_parallel:
        raise SystemExit(f"--seq {args.seq} is not a multiple of every --tp-options "
                         f"{args.tp_options}: sequence parallelism cuts it evenly. "
                         "Pick one that is.")
    if os.environ.get("RANK", "0") == "0":
        print(f"{n_params:,} parameters", flush=True)
    began = time.perf_counter()
    compute = SimulatedCompute(args.step_time, args.step_time_until)

    def build(layout: ert.Layout) -> ert.ModelDescription:
        # the same model for every layout: the runtime cuts it
        return describe(**sizes, dtype=dtype, sequence_parallel=args.sequence_parallel)

    def report(step: ert.StepReport) -> None:
        compute()  # simulated compute, so a test can kill mid-run
        if ert.context().rank == 0 and (step.step % 20 == 0 or step.step in (1, 5, 10)):
            print(f"step {step.step} loss {step.loss:.4f} layout {ert.context().layout} "
                  f"{time.perf_counter() - began:.0f} s", flush=True)

    checkpoint = None
    if args.checkpoint:
        # by the whole model's parameter names: it loads into any pp x tp cut
        checkpoint = ert.Checkpointer(args.checkpoint, every_steps=args.every)
    state = ert.run(
        build=build,
        step=None,  # the loss is the description's: the runtime runs the pipeline
        model_parallel=ert.ModelParallel(schedule=args.schedule),
        dataset=CharWindows(args.seq, args.samples),
        global_batch_size=args.global_batch,
        max_steps=args.steps,
        limits=limits(n_params, args),
        checkpoint=checkpoint,
        on_step=report,
    )
    if args.out:
        # run() has destroyed the groups (no collectives now): each rank writes its pieces and
        # where each sits in the whole tensor. Stages keep the whole model's names, so the
        # files together are the model (join_params).
        os.makedirs(args.out, exist_ok=True)
        pieces = {name: _piece(p.detach()) for name, p in state.model.named_parameters()}
        torch.save(pieces, os.path.join(args.out, f"rank-{ert.context().rank}.pt"))


Piece = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]  # offsets, whole shape, local


def _piece(p: torch.Tensor) -> Piece:
    """A parameter's local tensor and its place in the whole one (tensor-parallel or FSDP
    shard: a box of it, found without a collective)."""
    if isinstance(p, DTensor):
        (chunk,) = p.__create_chunk_list__()  # what torch.distributed.checkpoint saves
        return tuple(chunk.offsets), tuple(p.shape), p.to_local().clone()
    return (0,) * p.dim(), tuple(p.shape), p.clone()


def join_params(out: str) -> dict[str, torch.Tensor]:
    """The whole parameters from the pieces in ``--out`` (NaN where no rank wrote one)."""
    params: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(out)):
        for key, (offsets, shape, local) in torch.load(os.path.join(out, name)).items():
            whole = params.setdefault(key, torch.full(shape, math.nan, dtype=local.dtype))
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))] = local
    return params


if __name__ == "__main__":
    main()
