"""FSDP node loss: restore from peer memory vs from a local checkpoint, for ~100 MB of state.

Run under torchrun with 4 workers, taken as 2 nodes of 2 (``LOCAL_WORLD_SIZE=2``)::

    torchrun --standalone --nproc-per-node 4 scripts/bench/fsdp_recovery.py

The runtime's own trainer (``ShardedTrainer``) trains an MLP of ``--width`` x ``--layers``
(1448 x 4: 8.4M parameters, 33.6 MB, plus AdamW's two moments: ~100 MB of state) as
``fsdp4``, first with peer copies off, then with copies every step, and commits a checkpoint
to a local folder. Then ranks 2 and 3 (the second node) leave; ranks 0 and 1 form ``fsdp2``
groups and restore:

- *peer memory*: the surviving trainers, whose pieces and copies cover the lost ones;
- *checkpoint*: fresh trainers holding nothing, so they load the committed checkpoint.

Printed: the restore time of each (median of ``--repeats``, from the start of the restore to
the state in place, as the loop's ``state.restored`` event measures it); the cost of the
copies to a step: the step time with copies against without (medians, first step left out;
a step with copies includes the snapshot at its end and any wait for the previous send); and
the host memory the copies hold per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.layout import Layout
from elastic_rt.process_groups import destroy_groups, init_groups
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.context import Context
from elastic_rt.worker.allocator import SHARDED_TRIM_THRESHOLD_BYTES, pin_heap
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers import Progress, Restoring, StepOptions
from elastic_rt.worker.trainers.sharded.trainer import ShardedTrainer

TIMEOUT = timedelta(seconds=120)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1448)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def make_build(width: int, layers: int):  # noqa: ANN201 - a BuildFn
    def build(layout: Layout) -> TrainState:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    return build


def step_fn(state: TrainState, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(state.model(x), y)


def join(store: dist.Store, rank: int, layout: Layout, prefix: str) -> Context:
    groups = init_groups(store, rank=rank, world_size=layout.world_size, layout=layout,
                         prefix=prefix, timeout=TIMEOUT)
    return Context(rank=rank, world_size=layout.world_size, local_rank=rank % 2,
                   node_id=f"n{rank // 2}",
                   round=0, token=0, layout=layout, groups=groups)


def timed_restore(trainer: ShardedTrainer, ctx: Context, ckpt: Checkpointer | None,
                  progress: Progress, sampler: ElasticSampler) -> tuple[float, str]:
    dist.barrier(group=ctx.groups.world)
    began = time.perf_counter()
    source = trainer.restore(Restoring(ctx=ctx, checkpoint=ckpt, sampler=sampler,
                                       progress=progress)).source
    dist.barrier(group=ctx.groups.world)
    return time.perf_counter() - began, source


def main() -> None:
    args = parse_args()
    pin_heap(trim_threshold_bytes=SHARDED_TRIM_THRESHOLD_BYTES)  # as run() does for FSDP
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two: copies go to the other pair
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=TIMEOUT)
    folder = tempfile.gettempdir() + f"/fsdp-recovery-{os.environ['MASTER_PORT']}"
    build = make_build(args.width, args.layers)
    batch = (torch.randn(8, args.width), torch.randn(8, args.width))
    samples = ElasticSampler(64, global_batch_size=8)
    results: dict[str, list[float]] = {"peer memory": [], "checkpoint": []}
    for repeat in range(args.repeats):
        ctx = join(store, rank, Layout(dp=4, shard=4), f"/r{repeat}/a/")
        step_s: dict[int, float] = {}
        for every in (0, 1):  # copies off, then every step
            trainer = ShardedTrainer(build, step_fn, StepOptions(), copy_every=every)
            progress = Progress()
            trainer.restore(Restoring(ctx=ctx, checkpoint=None, sampler=samples,
                                      progress=progress))
            step_times = []
            for step in range(1, args.steps + 1):
                began = time.perf_counter()
                trainer.train([(batch, 8)], global_len=8, ctx=ctx, step=step)
                step_times.append(time.perf_counter() - began)
                progress.step = step
            step_s[every] = statistics.median(step_times[1:] or step_times)
            if not every:
                trainer.release()
        assert trainer.copies is not None  # the last step sent its snapshot
        copies_mib = trainer.copies.host_bytes() / 2**20
        ckpt = Checkpointer(f"file://{folder}/{repeat}")
        ckpt.save(progress.step, trainer.checkpoint_state(), layout=ctx.layout.to_dict(),
                  extra=trainer.checkpoint_meta(step=progress.step, sampler=samples).encode(),
                  process_group=ctx.groups.world)
        ckpt.wait()
        trainer.release()  # waits for the send in flight: the snapshot of the last step
        assert trainer.snapshots and trainer.snapshots[-1].step == args.steps
        destroy_groups(ctx.groups)
        if rank >= 2:
            continue  # the lost node
        ctx = join(store, rank, Layout(dp=2, shard=2), f"/r{repeat}/b/")
        took, source = timed_restore(trainer, ctx, None, progress, samples)
        assert source == "peer copies", source
        results["peer memory"].append(took)
        fresh = ShardedTrainer(build, step_fn, StepOptions())
        took, source = timed_restore(fresh, ctx, ckpt, Progress(), samples)
        assert source.startswith("checkpoint"), source
        results["checkpoint"].append(took)
        ckpt.close()
        destroy_groups(ctx.groups)
        if rank == 0:
            print(f"repeat {repeat + 1}: restore from peer memory "
                  f"{results['peer memory'][-1]:.2f} s, from checkpoint "
                  f"{results['checkpoint'][-1]:.2f} s; step with copies "
                  f"{step_s[1] * 1000:.0f} ms vs without {step_s[0] * 1000:.0f} ms; copies "
                  f"{copies_mib:.0f} MiB per rank "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    if rank == 0:
        state_mb = 3 * 4 * args.layers * (args.width * args.width + args.width) / 2**20
        peer, disk = (statistics.median(v) for v in results.values())
        print(f"\nfsdp4 -> fsdp2 after losing a node, {state_mb:.0f} MiB of state "
              f"(params + AdamW), load average {os.getloadavg()[0]:.1f}:")
        print(f"  restore from peer memory: {peer:.2f} s (target <= 1.0 s: "
              f"{'met' if peer <= 1.0 else 'MISSED'})")
        print(f"  restore from a local checkpoint: {disk:.2f} s ({disk / peer:.1f}x)")


if __name__ == "__main__":
    main()
