"""The model-parallel family: an object that owns its step (a pipeline stage, a tensor part).

Rule: the object is rebuilt for each round's layout (its groups die with the round); its
state then comes from

1. surviving ranks, when they hold every ``(pp, tp)`` part of one cut cleanly at one step
   (``part_broadcast``): 0 steps lost;
2. else the newest committed checkpoint, loaded into the new cut: the step counter and the
   sampler roll back with it (work lost <= the checkpoint interval);
3. else, on a fresh start only, the object as built (replicas are built identical).
"""

from __future__ import annotations

from typing import Any

from elastic_rt.layout import Layout
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.context import Context
from elastic_rt.worker.failures import user_code
from elastic_rt.worker.trainers.checkpoint_restore import from_checkpoint_or_init, load_checkpoint
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.model_parallel.part_broadcast import (
    Holder,
    broadcast_parts,
    gather_holders,
    pick_part_sources,
)
from elastic_rt.worker.trainers.protocol import BuildFn, Restored, Restoring, SteppedModel


class OwnedStepTrainer:
    """An object that owns its step, one per rank, rebuilt at every restore."""

    def __init__(self, build: BuildFn) -> None:
        self.build = build
        self.state: SteppedModel | None = None
        self.built_for: tuple[Layout, int] | None = None  # (layout, rank) of the state

    def result(self) -> Any:
        return self.state

    def restore(self, at: Restoring) -> Restored:
        return Restored(self._restore(at))

    def _restore(self, at: Restoring) -> str:
        ctx, progress = at.ctx, at.progress
        old, built_for = self.state, self.built_for
        mine = Holder.of(step=progress.step, is_clean=not progress.is_dirty,
                         layout=built_for[0] if built_for else None,
                         rank=built_for[1] if built_for else None)
        holders = gather_holders(mine, ctx.groups.world)
        # The old object's groups are gone, so everybody builds anew (it may hold its
        # state until the broadcast below has read it).
        progress.is_dirty = True  # until the new object holds the state of `step`
        self.state, self.built_for = self.build(ctx.layout), (ctx.layout, ctx.rank)
        found = pick_part_sources(holders, ctx.layout)
        if found is not None:
            step, sources = found
            coords = ctx.layout.coords(ctx.rank)
            payload = broadcast_parts(
                lambda: {"trainer": old.state_dict(),  # type: ignore[union-attr]
                         "meta": at.meta(old, step=step).encode()},
                sources, (coords.pp, coords.tp), ctx.groups.world,
            )  # fmt: skip
            self.state.load_state_dict(payload["trainer"])
            at.take(TrainMeta.decode(payload["meta"]), self.state)
            progress.step, progress.is_dirty = step, False
            return "replicas"
        old = None  # free its tensors before the checkpoint is read
        target = self.checkpoint_state()
        return from_checkpoint_or_init(at, lambda: load_checkpoint(target, at), state=self.state,
                                       last=max(h.last_step for h in holders))

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        assert self.state is not None
        with user_code(rank=ctx.rank, step=step):
            loss = float(self.state.step(micro_batches[0][0] if micro_batches else None))
        return loss, loss / max(ctx.dp_size, 1)

    def is_step_atomic(self) -> bool:
        return bool(getattr(self.state, "is_step_atomic", False))

    def compute_seconds(self) -> float | None:
        """None: the object's step runs its own collectives (pipeline sends, TP reduces)."""
        return None

    def checkpoint_state(self) -> dict[str, Any]:
        return {"trainer": self.state}

    def checkpoint_meta(self, *, step: int, sampler: ElasticSampler) -> TrainMeta:
        return TrainMeta.capture(step=step, sampler=sampler, state=self.state)

    def prepare(self, layout: Layout) -> bool:
        """Nothing ahead of the round: the object takes its groups while it is built."""
        return False

    def hand_over(self, ctx: Context, step: int) -> None:
        """Nothing: a leaver's parts come from ranks holding the same cut, else from the
        checkpoint (a part with no replica costs the steps since it; docs/sharding.md)."""

    def release(self) -> None:
        """Nothing to let go: the object is rebuilt at the next restore."""
