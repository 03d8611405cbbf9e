"""Step time of the runtime-parallel family against its torch twin, in the same processes.

The twin is what a user writes by hand with torch alone: ``nn.Sequential`` stages of the
same decoder (``scripts/examples/described_train.py``), ``PipelineStage`` +
``Schedule1F1B`` for ``pp2``, ``parallelize_module`` with the same plan for ``tp2``, and for
``fsdp2xtp2`` that plan, then ``fully_shard`` per block and on the root over the dp mesh
(torchtitan's order), AdamW. The runtime's side is ``RuntimeParallelTrainer.train`` (loss
weighting per micro-batch, the loss broadcast to every stage, the dp gradient sum, batches to
the device) on the same round's groups, each dp rank on its share. Blocks of ``--window``
steps alternate between the two so both see the same load; the figure is the median block
time per step of each, and their ratio.

Run:  python scripts/bench/runtime_parallel_step.py --layout pp2        # 2 gloo processes
      python scripts/bench/runtime_parallel_step.py --layout tp2
      python scripts/bench/runtime_parallel_step.py --layout fsdp2xtp2  # 4 gloo processes
      python scripts/bench/runtime_parallel_step.py --layout tp2 --sequence-parallel
(``--sequence-parallel``: both sides take the example's sequence-parallel plans, the twin
through ``parallelize_module`` on the blocks and on the model's outer modules.)

Measured 2026-12-06 on this 2-core machine with nothing else running (load average < 1),
the example's Llama-style decoder (3.2M parameters), global batch 16 x 64 characters, 60
steps a side: pp2 247.6 vs 247.2 ms (1.002), tp2 311.1 vs 310.4 ms (1.002), fsdp2xtp2
452.3 vs 454.0 ms (0.996). Under a load average of 3-7 (other jobs) the ratio wanders by
+-5-15 % either way (pp2 0.86-1.05, tp2 0.94-1.16, fsdp2xtp2 1.045): the machine's noise.
With ``--sequence-parallel`` (the same day, nothing else running): tp2 334.8 vs 355.5 ms
(0.942), beside tp2 without it 262.3 vs 269.4 ms (0.974): on gloo the gathers and
reduce-scatters around every norm cost more than the norms they cut.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import default_collate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from elastic_rt.layout import Layout  # noqa: E402
from elastic_rt.process_groups import destroy_groups, init_groups  # noqa: E402
from elastic_rt.sampler import ElasticSampler  # noqa: E402
from elastic_rt.worker.context import Context  # noqa: E402
from elastic_rt.worker.trainers import Progress, Restoring  # noqa: E402
from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel  # noqa: E402
from elastic_rt.worker.trainers.runtime_parallel.trainer import (  # noqa: E402
    RuntimeParallelTrainer,
)
from scripts.examples import described_train as ex  # noqa: E402

LAYOUTS = {"pp2": Layout(dp=1, pp=2), "tp2": Layout(dp=1, tp=2),
           "fsdp2xtp2": Layout(dp=2, tp=2, shard=2)}
MODEL: dict[str, Any] = {"width": 256, "depth": 4, "heads": 8}
SEQ = 64
GLOBAL_BATCH = 16


def _twin(layout: Layout, rank: int, groups: Any, sequence_parallel: bool) -> Any:
    """A step function written with torch alone, on the round's groups."""
    described = ex.describe(**MODEL)
    model: Any = described.model
    if layout.tp > 1:
        plan = ex.SEQUENCE_BLOCK_PLAN if sequence_parallel else ex.BLOCK_TP_PLAN
        for block in model.layers:
            parallelize_module(block, groups.mesh["tp"], dict(plan))
        if sequence_parallel:
            parallelize_module(model, groups.mesh["tp"], dict(ex.SEQUENCE_OUTER_PLAN))
        if layout.shard > 1:  # torchtitan's order: TP, then FSDP2 per block and the root
            for block in model.layers:
                fully_shard(block, mesh=groups.shard_mesh)
            fully_shard(model, mesh=groups.shard_mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

        def tp_step(ids: torch.Tensor, target: torch.Tensor) -> None:
            optimizer.zero_grad()
            ex.next_char_loss(model(ids), target).backward()
            optimizer.step()
        return tp_step
    half = len(model.layers) // 2
    parts = ([model.embed, *model.layers[:half]] if rank == 0
             else [*model.layers[half:], model.norm, model.head])
    stage_module = nn.Sequential(*parts)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"), group=groups.pp)
    schedule = Schedule1F1B(stage, 2, loss_fn=ex.next_char_loss)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=3e-3)

    def pp_step(ids: torch.Tensor, target: torch.Tensor) -> None:
        optimizer.zero_grad()
        schedule.step(*((ids,) if rank == 0 else ()), target=target if rank == 1 else None,
                      return_outputs=False)
        optimizer.step()
    return pp_step


def _worker(rank: int, port: int, name: str, steps: int, window: int, sequence_parallel: bool,
            out: Any) -> None:
    torch.set_num_threads(1)
    layout = LAYOUTS[name]
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60))
    groups = init_groups(store, rank=rank, world_size=layout.world_size, layout=layout,
                         prefix="/bench/", timeout=timedelta(seconds=60))
    ctx = Context(rank=rank, world_size=layout.world_size, local_rank=rank, node_id="n",
                  round=0, token=0, layout=layout, groups=groups)
    data = ex.CharWindows(SEQ, 4096)
    sampler = ElasticSampler(len(data), global_batch_size=GLOBAL_BATCH, seed=0)
    trainer = RuntimeParallelTrainer(
        lambda _: ex.describe(**MODEL, sequence_parallel=sequence_parallel), ModelParallel())
    trainer.restore(Restoring(ctx=ctx, checkpoint=None, sampler=sampler, progress=Progress()))
    sampler.set_world(ctx.dp_rank, ctx.dp_size)
    twin = _twin(layout, rank, groups, sequence_parallel)
    batch = default_collate([data[i] for i in sampler.local_batch()])
    times: dict[str, list[float]] = {"runtime": [], "torch": []}
    for block in range(2 * steps // window):
        side = "runtime" if block % 2 else "torch"
        dist.barrier(group=groups.world)
        began = time.perf_counter()
        for _ in range(window):
            if side == "runtime":
                trainer.train([(batch, len(batch[0]))], global_len=GLOBAL_BATCH, ctx=ctx, step=1)
            else:
                twin(*batch)
        if block >= 2:  # the first of each side warms up
            times[side].append((time.perf_counter() - began) / window)
    if rank == 0:
        out.put({side: statistics.median(t) for side, t in times.items()})
    trainer.release()
    destroy_groups(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2")
    parser.add_argument("--steps", type=int, default=60, help="steps per side")
    parser.add_argument("--window", type=int, default=5, help="steps per block")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="the example's sequence-parallel plans (tp layouts)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29_000 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(rank, port, args.layout, args.steps,
                                               args.window, args.sequence_parallel, out))
             for rank in range(LAYOUTS[args.layout].world_size)]
    for proc in procs:
        proc.start()
    try:
        result = out.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    name = args.layout + (" sequence-parallel" if args.sequence_parallel else "")
    print(f"{name}: runtime {result['runtime'] * 1000:.1f} ms/step, torch twin "
          f"{result['torch'] * 1000:.1f} ms/step, ratio {result['runtime'] / result['torch']:.3f}")


if __name__ == "__main__":
    main()
