"""Pipeline-parallel training that survives losing a whole stage. Run it with

    elastic-rt launch --nnodes 1:2 --nproc-per-node 2 scripts/examples/pipeline_train.py \\
        --checkpoint /tmp/pipeline-ckpt --every 10

The model (``elastic_rt.harness.parallel_models.MLP``) is too big for one rank under
``LIMITS``, so the planner cuts it into pipeline stages: two nodes of two workers train
``dp2 x pp2``, one node holding each stage. When a node dies its stage has no replica left,
so the survivors roll back to the last committed checkpoint, re-plan (``pp2`` on the two
ranks left), load it resharded and go on. The steps after the checkpoint are done again, on
the same batches, so the run ends where an uninterrupted one would.

The script writes ``build`` (one rank's stage for a layout) and nothing about failures.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch

import elastic_rt as ert

from elastic_rt.harness import parallel_models as pm

N_PARAMS = pm.DEPTH * (2 * (pm.WIDTH * 2 * pm.WIDTH) + 2 * pm.WIDTH + pm.WIDTH)
# Half the model fits a rank, the whole model does not: at least two pipeline stages.
LIMITS = ert.ModelLimits(max_pp=pm.DEPTH, max_params_per_rank=N_PARAMS // 2, n_params=N_PARAMS)


class Stage:
    """This rank's piece of the model, trained on its data-parallel share of each batch."""

    # The trainer does every collective before its optimizer update, so a step cut short by a
    # dead peer changed nothing: survivors holding a replica of each stage lose no steps.
    is_step_atomic = True

    def __init__(self, trainer: pm.Trainer, global_batch: int, step_time: float) -> None:
        self.trainer, self.global_batch, self.step_time = trainer, global_batch, step_time

    def step(self, share: pm.Batch) -> float:
        if self.step_time:
            time.sleep(self.step_time)  # simulated compute, so a test can kill mid-run
        return self.trainer.step_share(share, self.global_batch)

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="train this many steps")
    p.add_argument("--global-batch", type=int, default=12, help="samples per step, all ranks")
    p.add_argument("--samples", type=int, default=240, help="dataset size")
    p.add_argument("--checkpoint", default=None, help="checkpoint URL (path, file://, s3://)")
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step (s)")
    p.add_argument("--out", default=None, help="folder: each rank writes its parameters there")
    return p.parse_args()


def main() -> None:
    args = parse_args()

    def build(layout: ert.Layout) -> Stage:
        """This rank's stage for ``layout``; called again after every re-form."""
        return Stage(pm.build(layout, ert.context().groups), args.global_batch, args.step_time)

    checkpoint = None
    if args.checkpoint:
        # A save's collectives wait at most this long for a peer that died under them, so
        # a node lost mid-save delays recovery by this much, not by the 10 minute default.
        checkpoint = ert.Checkpointer(args.checkpoint, every_steps=args.every,
                                      collective_timeout=timedelta(seconds=15))
    stage = ert.run(
        build=build,
        step=None,  # the stage owns its step: forward, send/recv, backward, optimizer
        dataset=pm.Pairs(args.samples),
        global_batch_size=args.global_batch,
        max_steps=args.steps,
        checkpoint=checkpoint,
        limits=LIMITS,
    )
    if args.out:
        # Stages keep the full model's parameter names, so the files together are the model.
        os.makedirs(args.out, exist_ok=True)
        ctx = ert.context()
        torch.save(stage.trainer.full_params(), os.path.join(args.out, f"rank-{ctx.rank}.pt"))


if __name__ == "__main__":
    main()
