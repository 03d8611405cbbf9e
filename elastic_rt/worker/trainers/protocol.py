"""What the loop sees of a trainer: :class:`Trainer`, and what a restore reads and moves.

Rule: the loop calls ``restore`` after every re-form (it says where the state came from and
how many bytes of it this rank moved, :class:`Restored`), then ``train`` step by step; it saves
``checkpoint_state()`` (tensors, loaded by name into any layout) with
``checkpoint_meta(...).encode()`` beside them, and calls ``release`` before the round's groups
are destroyed. Nothing else of a trainer is the loop's business. A restore moves the loop's
position (:class:`Progress`, the sampler) to that of the :class:`TrainMeta` it restores, with
:meth:`Restoring.take`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from elastic_rt.layout import Layout
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.context import Context
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.runtime_step import ReplicatedStep

if TYPE_CHECKING:  # a job without checkpoints never loads torch.distributed.checkpoint
    from elastic_rt.checkpoint import Checkpointer

BuildFn = Callable[[Layout], Any]
"""Returns a :class:`TrainState`, or a :class:`SteppedModel` when ``step`` is None."""


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
    paused_at: float | None = None
    """When training stopped (a failed step, or a boundary a member left at): the next
    completed step reports the pause (``step.resumed``)."""
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Restoring:
    """What a restore may read and must move: the checkpoint, the sampler, the progress."""

    ctx: Context
    checkpoint: Checkpointer | None
    sampler: ElasticSampler
    progress: Progress
    run_reached: Callable[[], int] = lambda: -1
    """The newest step the run has published (its ``progress`` key), -1 before its first or
    outside ``elastic-rt launch``: what a restore that finds no state must not start over from."""

    def meta(self, state: object, stepper: ReplicatedStep | None = None, *,
             step: int | None = None) -> TrainMeta:
        """The record of ``state`` at this rank's position (at ``step`` when given)."""
        return TrainMeta.capture(step=self.progress.step if step is None else step,
                                 sampler=self.sampler, state=state, stepper=stepper)

    def take(self, meta: TrainMeta, state: object,
             stepper: ReplicatedStep | None = None) -> None:
        """Move the position to ``meta``'s and load the rest of it into ``state``."""
        self.sampler.load_state_dict(meta.sampler)
        self.progress.step = meta.step
        meta.apply(state=state, stepper=stepper)


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore did, for the loop's ``state.restored`` event."""

    source: str
    """Where the state came from: ``kept``, ``rank 0``, ``checkpoint <name>``, ``init``..."""
    bytes_moved: int | None = None
    """Bytes of state this rank sent or received from other ranks; None where the family
    does not count them (a checkpoint read, the sharded and model-parallel families)."""
    receiving: tuple[int, ...] = ()
    """Data-parallel ranks whose state is still arriving: it lands in the next step, before
    its update, and every rank holds the same state after it (a join streamed while the
    holders train); until then the world waits for that step to re-form."""
    sitting_out: tuple[int, ...] = ()
    """Those of :attr:`receiving` that train no samples in the next step (the others split
    its global batch) and take its averaged gradients."""
    stream_seconds: Callable[[], float | None] | None = None
    """Once the state has landed: how long its stream took from its start to the last byte
    (the transfer's own speed; the landing also waits for the step it hides in)."""


class Trainer(Protocol):
    """One rank's trainable state and how it steps, restores and is checkpointed."""

    def result(self) -> Any:
        """What ``run`` returns: the ``TrainState`` or the object ``build`` made."""

    def prepare(self, layout: Layout) -> bool:
        """Build ahead of the round, outside any (a standby worker, for the layout its
        admission will most likely give), so that nobody waits on it then; may do nothing.
        Whether it built this rank's state (:meth:`checkpoint_state` then holds it)."""

    def restore(self, at: Restoring) -> Restored:
        """Bring this rank's state to the newest step any rank holds."""

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        """(mean loss over this rank's samples, its part of the global-batch mean)."""

    def is_step_atomic(self) -> bool:
        """Whether a step that raises leaves the state of the last committed step."""

    def compute_seconds(self) -> float | None:
        """The last step's own forward and backward, without waits on peers; None where
        collectives run inside the forward and the two cannot be told apart, and then
        the loop does not measure the rank's busy time either (``worker/stragglers.py``)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """The tensors a checkpoint saves and loads into (by name, into any layout)."""

    def checkpoint_meta(self, *, step: int, sampler: ElasticSampler) -> TrainMeta:
        """The record saved beside the tensors (its :meth:`TrainMeta.encode` is ``extra``)."""

    def hand_over(self, ctx: Context, step: int) -> None:
        """A member leaves at this step boundary (after ``step``): put this rank's state
        where the others can restore ``step`` from without the leaver. Collective (every rank of the
        round calls it at the same boundary); nothing for replicas, which hold it all."""

    def release(self) -> None:
        """Let go of the round's groups (they are about to be destroyed)."""
