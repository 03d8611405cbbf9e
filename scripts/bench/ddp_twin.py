"""The plain torchrun + DDP twin of ``scripts/examples/elastic_train.py``.

Same data (the example's ``Regression`` dataset), same model and initial weights,
same global batch split evenly over the ranks, same loss (MSE, mean over the
global batch: DDP averages the ranks' means), same AdamW. Only the loop differs:
a ``DistributedSampler`` + ``DataLoader`` feed a ``DistributedDataParallel``
model, as a torchrun user would write it. Rank 0 writes the wall-clock end time
of every step to ``--times`` (a JSON list) when done, so timing costs nothing
during the run.

Run:  torchrun --standalone --nproc-per-node 2 scripts/bench/ddp_twin.py --times t.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.examples.elastic_train import Regression  # noqa: E402  (the same data)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--times", default=None, help="rank 0 writes step end times here (JSON)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(
            f"--global-batch {args.global_batch} must divide by the world size {world}"
        )
    dataset = Regression(n=args.global_batch * 50, width=args.width)
    sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor]] = DistributedSampler(
        dataset, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler,
                        drop_last=True)
    torch.manual_seed(0)  # the example's initial model
    model = DDP(torch.nn.Sequential(
        torch.nn.Linear(args.width, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    ))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    times: list[float] = []
    epoch = 0
    while len(times) < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append(time.time())
            if len(times) == args.steps:
                break
        epoch += 1
    if args.times and dist.get_rank() == 0:
        Path(args.times).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
