"""What the loop trains, behind one protocol: a replicated ``TrainState`` whose step the
runtime does, or an object that owns its step (model parallelism).

The loop only knows :class:`Trainer`: ``restore`` after every re-form (from surviving
ranks, else the newest committed checkpoint, else the initial state), ``train`` one step,
and the checkpoint's tensors and JSON. Both variants restore from storage through
:func:`load_checkpoint`, the one place that orders tensors, sampler and step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint.checkpointer import CheckpointInfo
from elastic_rt.errors import CheckpointNotFoundError, ElasticError
from elastic_rt.layout import Layout
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.trainers.model_parallel.part_broadcast import (
    Holder,
    broadcast_shards,
    gather_holders,
    pick_shard_sources,
)
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state, pick_source
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.failures import user_code
from elastic_rt.worker.trainers.runtime_step import (
    ReplicatedStep,
    StepFn,
    StepOptions,
    initialize_optimizer_state,
)
from elastic_rt.worker.context import Context

logger = logging.getLogger(__name__)

BuildFn = Callable[[Layout], Any]
"""Returns a :class:`TrainState`, or a :class:`SteppedModel` when ``step`` is None."""

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class SteppedModel(Protocol):
    """What ``build`` returns when it owns its step (``run(step=None)``): one rank's piece.

    ``step`` trains one step on this rank's data-parallel share of the global batch and
    returns the global batch's loss; it must scale its loss by the global batch size
    (fixed for the run), not by the share's. Replicas must be built identical (seeded).

    An object may set ``is_step_atomic = True`` when ``step`` applies its update only after
    its last collective, so that a step that raises (a peer died) has changed no parameter
    or optimizer state. Its state then still counts after a failed step, and surviving
    replicas can restore a lost one with no steps lost; without it, a failed step means the
    checkpoint.
    """

    def step(self, batch: Any) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    """The loop's position; trainers move it when they restore."""

    step: int = -1
    """Committed steps; -1 until this rank holds state."""
    is_dirty: bool = False
    """The state may not match ``step``: a step or a restore started and did not finish
    (an owned step may have applied its update before a later collective failed)."""
    failed_attempts: int = 0
    failed_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Restoring:
    """What a restore may read and must move: the checkpoint, the sampler, the progress."""

    ctx: Context
    checkpoint: Checkpointer | None
    sampler: ElasticSampler
    progress: Progress


class Trainer(Protocol):
    """One rank's trainable state and how it steps, restores and is checkpointed."""

    def result(self) -> Any:
        """What ``run`` returns: the ``TrainState`` or the object ``build`` made."""

    def restore(self, at: Restoring) -> str:
        """Bring this rank's state to the newest step any rank holds; where it came from."""

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        """(mean loss over this rank's samples, its part of the global-batch mean)."""

    def is_step_atomic(self) -> bool:
        """Whether a step that raises leaves the state of the last committed step."""

    def checkpoint_state(self) -> dict[str, Any]:
        """The tensors a checkpoint saves and loads into (resharding by name)."""

    def checkpoint_extra(self) -> dict[str, Any]:
        """JSON-able state saved beside the tensors (schedule, scaler, user extras)."""

    def release(self) -> None:
        """Let go of the round's groups (they are about to be destroyed)."""


def load_checkpoint(target: dict[str, Any], at: Restoring) -> CheckpointInfo | None:
    """The newest committed checkpoint into ``target``, then the sampler and the step.

    None when there is no checkpointer or nothing is committed yet.
    """
    if at.checkpoint is None:
        return None
    try:
        info = at.checkpoint.load(target, process_group=at.ctx.groups.world)
    except CheckpointNotFoundError:
        return None
    if info is not None:
        at.sampler.load_state_dict(info.extra["sampler"])
        at.progress.step = int(info.extra["step"])
    return info


def load_checkpoint_into(state: TrainState, state_tree: Callable[[], dict[str, Any]],
                         at: Restoring) -> CheckpointInfo | None:
    """The newest committed checkpoint into ``state``'s model and optimizer, as
    :func:`load_checkpoint`; ``state_tree`` gives the tensors to load into.

    A checkpoint loads into existing tensors, so an empty optimizer gets its state first,
    without a user-visible ``optimizer.step()``. When nothing is loaded that zero-step state
    is dropped again: Adam's step count 1 would make its bias correction lag one step
    behind a run without checkpoints.
    """
    fresh_optimizer = initialize_optimizer_state(state.optimizer)
    target = state_tree()
    info = load_checkpoint(target, at)
    if info is not None:
        set_state_dict(state.model, state.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"], options=_FLAT)
    elif fresh_optimizer:
        state.optimizer.state.clear()
    return info


class ReplicatedTrainer:
    """A ``TrainState`` replicated on every data-parallel rank; the runtime does its step.

    Built once per worker (survivors keep theirs). A lost replica is restored by broadcast
    from the most advanced survivor; with no survivor holding state, from the checkpoint.
    """

    def __init__(self, build: BuildFn, step_fn: StepFn, options: StepOptions) -> None:
        self.build, self.step_fn, self.options = build, step_fn, options
        self.state: TrainState | None = None
        self.stepper: ReplicatedStep | None = None

    def result(self) -> Any:
        return self.state

    def restore(self, at: Restoring) -> str:
        if self.state is None or self.stepper is None:
            self.state = self.build(at.ctx.layout)
            self.stepper = ReplicatedStep(self.state, self.step_fn, self.options)
        group = at.ctx.groups.world
        src, best = pick_source(at.progress.step, group)
        if best < 0:
            source = self._from_checkpoint_or_init(at)
        else:
            payload = broadcast_state({
                "train": self.state.state_dict(), "runtime": self.stepper.runtime_state(),
                "sampler": at.sampler.state_dict(), "step": at.progress.step,
            }, src, group)  # fmt: skip
            self.state.load_state_dict(payload["train"])
            self.stepper.load_runtime_state(payload["runtime"])
            at.sampler.load_state_dict(payload["sampler"])
            at.progress.step = int(payload["step"])
            source = f"rank {src}"
        self.stepper.bind(at.ctx.groups.dp)
        return source

    def _from_checkpoint_or_init(self, at: Restoring) -> str:
        assert self.state is not None and self.stepper is not None
        if at.checkpoint is not None:
            info = load_checkpoint_into(self.state, self.checkpoint_state, at)
            if info is not None:
                self.state.extras = dict(info.extra.get("extras", {}))
                if self.state.scheduler is not None and info.extra.get("scheduler"):
                    self.state.scheduler.load_state_dict(info.extra["scheduler"])
                self.stepper.load_runtime_state(info.extra.get("runtime", {}))
                return f"checkpoint {info.name}"
        synced = broadcast_state(self.state.model.state_dict(), 0, at.ctx.groups.world)
        self.state.model.load_state_dict(synced)
        at.progress.step = 0
        return "init"

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        assert self.stepper is not None
        loss = self.stepper.run(micro_batches, global_len=global_len, rank=ctx.rank, step=step)
        return loss.local_mean, loss.contribution

    def is_step_atomic(self) -> bool:
        return True  # the runtime's step updates the state only after its last collective

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter name, so it reshards.

        An optimizer's own state_dict keys its state by parameter index, which
        collides between pipeline stages; the flattened form names each entry.
        """
        assert self.state is not None
        return named_state(self.state)

    def checkpoint_extra(self) -> dict[str, Any]:
        assert self.state is not None and self.stepper is not None
        return runtime_extra(self.state, self.stepper)

    def release(self) -> None:
        if self.stepper is not None:
            self.stepper.unbind()


class OwnedStepTrainer:
    """An object that owns its step, rebuilt for each round's layout (its groups die with
    the round). Its state comes from surviving ranks when they hold every shard of one cut
    at one step (``shard_sync``), else from the checkpoint, resharded: the step counter and
    the sampler roll back with it (work lost <= the checkpoint interval).
    """

    def __init__(self, build: BuildFn) -> None:
        self.build = build
        self.state: SteppedModel | None = None
        self.built_for: tuple[Layout, int] | None = None  # (layout, rank) of the state

    def result(self) -> Any:
        return self.state

    def restore(self, at: Restoring) -> str:
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
        found = pick_shard_sources(holders, ctx.layout)
        if found is not None:
            step, sources = found
            coords = ctx.layout.coords(ctx.rank)
            payload = broadcast_shards(
                lambda: {"trainer": old.state_dict(),  # type: ignore[union-attr]
                         "sampler": at.sampler.state_dict()},
                sources, (coords.pp, coords.tp), ctx.groups.world,
            )  # fmt: skip
            self.state.load_state_dict(payload["trainer"])
            at.sampler.load_state_dict(payload["sampler"])
            progress.step, progress.is_dirty = step, False
            return "replicas"
        old = None  # free its tensors before the checkpoint is read
        last = max(h.last_step for h in holders)
        info = load_checkpoint(self.checkpoint_state(), at)
        progress.is_dirty = False
        if info is not None:
            if last >= 0:
                logger.warning("no surviving replica of every shard at one step; rolled back "
                               "from step %d to %d", last, progress.step)
            return f"checkpoint {info.name}"
        if last >= 0:
            raise ElasticError(
                f"a model shard was lost at step {last} with no surviving replica "
                "and no committed checkpoint; pass checkpoint=Checkpointer(url, every_steps=N)"
            )
        progress.step = 0
        return "init"

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        assert self.state is not None
        with user_code(rank=ctx.rank, step=step):
            loss = float(self.state.step(micro_batches[0][0] if micro_batches else None))
        return loss, loss / max(ctx.dp_size, 1)

    def is_step_atomic(self) -> bool:
        return bool(getattr(self.state, "is_step_atomic", False))

    def checkpoint_state(self) -> dict[str, Any]:
        return {"trainer": self.state}

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"extras": getattr(self.state, "extras", {})}

    def release(self) -> None:
        """Nothing to let go: the object is rebuilt at the next restore."""


def named_state(state: TrainState) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (DTensor shards stay shards)."""
    model_state, optim_state = get_state_dict(state.model, state.optimizer, options=_FLAT)
    return {"model": model_state, "optimizer": optim_state}


def runtime_extra(state: TrainState, stepper: ReplicatedStep) -> dict[str, Any]:
    """What a checkpoint keeps beside the tensors: extras, scaler and scheduler state."""
    extra: dict[str, Any] = {"extras": state.extras, "runtime": stepper.runtime_state()}
    if state.scheduler is not None:
        extra["scheduler"] = state.scheduler.state_dict()
    return extra
