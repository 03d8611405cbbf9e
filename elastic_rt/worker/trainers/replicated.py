"""The replicated family: one ``TrainState`` on every data-parallel rank, stepped by the runtime.

Rule: a replica is restored whole, from the most advanced survivor::

    pick_source(step)  -> the lowest rank with the highest step
    best >= 0          -> broadcast its state and TrainMeta to every rank (0 steps lost)
    else               -> the newest committed checkpoint, else rank 0's build (a fresh start)

Built once per worker: survivors keep theirs, and their state is already that of the last
committed step (the runtime's step changes it only after its last collective).
"""

from __future__ import annotations

from typing import Any

from elastic_rt.worker.context import Context
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.checkpoint_restore import (
    from_checkpoint_or_init,
    load_checkpoint_into,
)
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.protocol import BuildFn, Restoring
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state, pick_source
from elastic_rt.worker.trainers.runtime_step import ReplicatedStep, StepFn, StepOptions
from elastic_rt.worker.trainers.train_state_trainer import TrainStateTrainer


class ReplicatedTrainer(TrainStateTrainer):
    """A ``TrainState`` replicated on every data-parallel rank; the runtime does its step."""

    def __init__(self, build: BuildFn, step_fn: StepFn, options: StepOptions) -> None:
        self.build, self.step_fn, self.options = build, step_fn, options
        self.state: TrainState | None = None
        self.stepper: ReplicatedStep | None = None

    def restore(self, at: Restoring) -> str:
        if self.state is None or self.stepper is None:
            self.state = self.build(at.ctx.layout)
            self.stepper = ReplicatedStep(self.state, self.step_fn, self.options)
        state, stepper = self.state, self.stepper
        group = at.ctx.groups.world
        src, best = pick_source(at.progress.step, group)
        if best < 0:
            def init() -> None:  # rank 0's build is everybody's start
                state.model.load_state_dict(broadcast_state(state.model.state_dict(), 0, group))
            source = from_checkpoint_or_init(at, lambda: load_checkpoint_into(state, at),
                                             state=state, stepper=stepper, last=best, init=init)
        else:
            payload = broadcast_state({
                "model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "meta": at.meta(state, stepper).encode(),
            }, src, group)  # fmt: skip
            state.model.load_state_dict(payload["model"])
            state.optimizer.load_state_dict(payload["optimizer"])
            at.take(TrainMeta.decode(payload["meta"]), state, stepper)
            source = f"rank {src}"
        stepper.bind(at.ctx.groups.dp)
        return source

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        assert self.stepper is not None
        loss = self.stepper.run(micro_batches, global_len=global_len, rank=ctx.rank, step=step)
        return loss.local_mean, loss.contribution
