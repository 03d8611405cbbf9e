"""Train one small model under any layout (data, pipeline, tensor parallel, hybrids) with torchrun.

The model and its trainers are ``elastic_rt.harness.parallel_models``: a stack of residual MLP
blocks, under DDP, FSDP2, or a GPipe pipeline with Megatron-style tensor parallelism, each
trainer computing the same math as the single-process reference. Its checkpoints keep the full
model's names, so a run under one layout resumes under another, resharded.

Run it (a second run with another worker count resumes from the checkpoint, resharded)::

    torchrun --standalone --nproc-per-node 4 scripts/examples/parallel_models.py \\
        --layout dp2xpp2 --steps 10 --ckpt /tmp/pm-ckpt
    torchrun --standalone --nproc-per-node 3 scripts/examples/parallel_models.py \\
        --steps 20 --ckpt /tmp/pm-ckpt
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch.distributed as dist

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.harness.parallel_models import LIMITS, build, make_batch, parse_layout
from elastic_rt.layout import plan_layout
from elastic_rt.process_groups import destroy_groups, init_groups


def main(argv: list[str] | None = None) -> None:
    """Train under torchrun or ``elastic-rt launch``; resume from ``--ckpt`` if it has one.

    ``torchrun --nproc-per-node 4 scripts/examples/parallel_models.py --layout dp2xpp2``
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", help="e.g. dp2xpp2; default: planned for the world size")
    parser.add_argument("--steps", type=int, default=20, help="train up to this step")
    parser.add_argument("--ckpt", help="checkpoint URL (path, file://, s3://); resumes from it")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layout = parse_layout(args.layout) if args.layout else plan_layout(world, LIMITS)
    # Under torchrun the agent hosts the store and workers are its clients.
    is_host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=is_host, timeout=timedelta(minutes=5))
    groups = init_groups(store, rank=rank, world_size=world, layout=layout,
                         prefix="/parallel_models/", timeout=timedelta(minutes=5))
    trainer = build(layout, groups)
    ckpt = Checkpointer(args.ckpt) if args.ckpt else None
    start = 0
    if ckpt is not None and any(info.committed for info in ckpt.list()):
        start = ckpt.load({"trainer": trainer}, process_group=groups.world).step
    for step in range(start, args.steps):
        loss = trainer.step(make_batch(step))
        if rank == 0:
            print(f"step {step} layout {layout} loss {loss:.6f}", flush=True)
    if ckpt is not None:
        ckpt.save(args.steps, {"trainer": trainer}, layout=layout.to_dict(),
                  process_group=groups.world)
        ckpt.close()
    destroy_groups(groups)


if __name__ == "__main__":
    main()
