"""One training job, two loops: elastic-rt's ``run`` and the torchrun + DDP (or FSDP2) twin.

The same MLP (``--layers`` Linear layers of ``--width``, 4 x 2048 = 16.8M parameters by
default), the same data (optionally waiting ``--fetch-ms`` per sample, as a dataset that
reads from storage does), the same global batch, AdamW, and a DataLoader with
``--num-workers`` loader processes on both sides:

- ``--loop elastic``: run under ``elastic-rt launch``; ``elastic_rt.run`` with
  ``LoaderOptions(num_workers=...)``.
- ``--loop ddp``: run under ``torchrun``; ``DistributedSampler`` + ``DataLoader`` +
  ``DistributedDataParallel``, as a torchrun user writes it.
- ``--max-shard N`` with ``--loop elastic``: the runtime shards the model (FSDP2);
  ``--loop fsdp`` is its torchrun twin, ``fully_shard`` on each Linear and the root over
  every rank, as the runtime does.

Rank 0 keeps the wall-clock time at which each step starts, in memory, and writes them
to ``--times`` (JSON) at the end; every rank writes its peak RSS (``ru_maxrss``, MiB) and
its count of minor page faults at the start of each step (``ru_minflt``: memory the heap
gave back and the next step faulted in again) to ``--rss``.RANK.
``scripts/bench/overhead.py`` runs the two side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch


class Samples(torch.utils.data.Dataset):
    """Random regression pairs; ``fetch_ms`` of waiting per sample models storage latency."""

    def __init__(self, n: int, width: int, fetch_ms: float) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, width, generator=g)
        self.fetch_s = fetch_ms / 1000

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fetch_s:
            time.sleep(self.fetch_s)
        return self.x[i], self.y[i]


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for i in range(layers):
        blocks.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            blocks.append(torch.nn.ReLU())
    return torch.nn.Sequential(*blocks)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=["elastic", "ddp", "fsdp"], required=True)
    p.add_argument("--max-shard", type=int, default=1, help="elastic: shard over this many")
    p.add_argument("--peer-copy-every", type=int, default=1, help="elastic FSDP: peer copies")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--fetch-ms", type=float, default=0.0)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--times", required=True)
    p.add_argument("--rss", required=True)
    return p.parse_args()


def train_elastic(args: argparse.Namespace, times: list[float], faults: list[int]) -> int:
    import elastic_rt as ert

    def build(layout: ert.Layout) -> ert.TrainState:
        model = make_model(args.width, args.layers)
        return ert.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))

    def train_step(state: ert.TrainState, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        times.append(time.time())
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        x, y = batch
        return torch.nn.functional.mse_loss(state.model(x), y)

    ert.run(build=build, step=train_step,
            dataset=Samples(args.global_batch * 50, args.width, args.fetch_ms),
            global_batch_size=args.global_batch, max_steps=args.steps,
            loader=ert.LoaderOptions(num_workers=args.num_workers),
            limits=ert.ModelLimits(max_shard=args.max_shard),
            peer_copy_every=args.peer_copy_every)
    return ert.context().rank


def train_twin(args: argparse.Namespace, times: list[float], faults: list[int]) -> int:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dataset = Samples(args.global_batch * 50, args.width, args.fetch_ms)
    sampler: DistributedSampler[object] = DistributedSampler(dataset, shuffle=True, seed=0,
                                                             drop_last=True)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler,
                        drop_last=True, num_workers=args.num_workers,
                        persistent_workers=args.num_workers > 0)
    model: torch.nn.Module
    if args.loop == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = make_model(args.width, args.layers)
        for layer in model.modules():  # each Linear a unit, as the runtime's policy
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = DistributedDataParallel(make_model(args.width, args.layers))
    optimizer = torch.optim.AdamW(model.parameters())
    epoch = 0
    while len(times) < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            times.append(time.time())
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if len(times) == args.steps:
                break
        epoch += 1
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return rank


def main() -> None:
    args = parse_args()
    times: list[float] = []
    faults: list[int] = []
    train = train_elastic if args.loop == "elastic" else train_twin
    rank = train(args, times, faults)
    if rank == 0:
        times.append(time.time())  # the end of the last step
        Path(args.times).write_text(json.dumps(times))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(f"{args.rss}.{rank}").write_text(json.dumps({
        "pid": os.getpid(), "peak_mib": usage.ru_maxrss / 1024, "minflt": faults}))


if __name__ == "__main__":
    main()
