"""Sharded data parallelism (FSDP2) with elastic_rt: the user's code is the data-parallel one.

    elastic-rt launch --nnodes 1:2 --nproc-per-node 2 scripts/examples/fsdp_train.py

``build`` returns a plain model and optimizer; declaring ``max_shard`` in the limits is all it
takes for the runtime to shard parameters, gradients and optimizer state over the
data-parallel ranks (``fully_shard``): ``--max-shard 2`` with two workers per node gives HSDP
(sharded within a node, replicated across nodes), a large one FSDP over every rank. When a
node dies, the survivors re-shard to the new world in place: from a surviving replica (HSDP),
or from the copies of the lost shards that ranks keep in a peer's host memory (FSDP,
``--peer-copy-every``), else from the last committed checkpoint, resharded. The result equals a
run without failures.
"""

import argparse
import os

import torch

import elastic_rt as ert
from elastic_rt.harness.pace import SimulatedCompute
from torch.distributed.tensor import DTensor


class Regression(torch.utils.data.Dataset):
    """y = a noisy linear function of x: small, deterministic, fast."""

    def __init__(self, n: int, width: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, width, generator=g)
        self.y = self.x @ torch.randn(width, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_model(width: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank builds the same initial model
    return torch.nn.Sequential(
        torch.nn.Linear(width, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--max-shard", type=int, default=64,
                   help="most ranks one copy of the state is sharded over (nproc-per-node: HSDP)")
    p.add_argument("--step-time", type=float, default=0.0, help="simulated extra compute per step")
    p.add_argument("--step-time-until", default=None, metavar="FILE",
                   help="simulate compute only until FILE exists (tests hold a slow pace so)")
    p.add_argument("--checkpoint", default=None, help="URL for checkpoints (optional)")
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--peer-copy-every", type=int, default=1,
                   help="copy each rank's shards to the next node every N steps (0: off)")
    p.add_argument("--out", default=None, help="a folder: each rank writes its rows here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    compute = SimulatedCompute(args.step_time, args.step_time_until)

    def build(layout: ert.Layout) -> ert.TrainState:
        """A plain model and optimizer, as for data parallelism; the runtime shards them."""
        model = make_model(args.width, args.hidden)
        return ert.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))

    def train_step(state: ert.TrainState, batch) -> torch.Tensor:
        x, y = batch
        compute()
        return torch.nn.functional.mse_loss(state.model(x), y)

    checkpoint = (ert.Checkpointer(args.checkpoint, every_steps=args.every)
                  if args.checkpoint else None)
    state = ert.run(
        build=build,
        step=train_step,
        dataset=Regression(n=args.global_batch * 50, width=args.width),
        global_batch_size=args.global_batch,
        max_steps=args.steps,
        checkpoint=checkpoint,
        limits=ert.ModelLimits(max_shard=args.max_shard),
        peer_copy_every=args.peer_copy_every,
    )
    # run() has destroyed the groups (no collectives now): each rank writes its own rows.
    if args.out:
        ctx = ert.context()
        params = {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                  for name, p in state.model.named_parameters()}
        piece = {"index": ctx.layout.shard_index(ctx.rank), "of": ctx.layout.shard,
                 "params": params}
        os.makedirs(args.out, exist_ok=True)
        torch.save(piece, os.path.join(args.out, f"rank-{ctx.rank}.pt"))


def join_params(out: str) -> dict[str, torch.Tensor]:
    """The full parameters from the pieces ``--out`` holds (rows concatenated in order)."""
    pieces = {}
    for name in sorted(os.listdir(out)):
        piece = torch.load(os.path.join(out, name))
        pieces[piece["index"]] = piece
    ordered = [pieces[i]["params"] for i in range(pieces[0]["of"])]
    return {name: torch.cat([p[name] for p in ordered]) for name in ordered[0]}


if __name__ == "__main__":
    main()
