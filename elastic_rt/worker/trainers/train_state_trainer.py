"""What the replicated and sharded families share: a ``TrainState`` stepped by the runtime.

Rule: its checkpoint is the state by parameter name (``named_state``: any layout loads it) with
``TrainMeta.capture(state, stepper)`` beside it; a step that raises changed nothing, since the
runtime's step updates the state only after its last collective (``is_step_atomic``).
"""

from __future__ import annotations

from typing import Any

from elastic_rt.layout import Layout
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.context import Context
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.checkpoint_restore import named_state
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.runtime_step import ReplicatedStep


class TrainStateTrainer:
    """The :class:`Trainer` methods of a family holding ``state`` and its ``stepper``."""

    state: TrainState | None
    stepper: ReplicatedStep | None

    def result(self) -> Any:
        return self.state

    def prepare(self, layout: Layout) -> bool:
        """Nothing ahead of the round by default (FSDP wraps the model over its groups)."""
        return False

    def is_step_atomic(self) -> bool:
        return True

    def compute_seconds(self) -> float | None:
        """None by default: a sharded model's forward waits on its all-gathers."""
        return None

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state by parameter name; DTensors under FSDP/HSDP."""
        assert self.state is not None
        return named_state(self.state)

    def checkpoint_meta(self, *, step: int, sampler: ElasticSampler) -> TrainMeta:
        return TrainMeta.capture(step=step, sampler=sampler, state=self.state,
                                 stepper=self.stepper)

    def hand_over(self, ctx: Context, step: int) -> None:
        """Nothing: every replica holds the whole state of the step (see the sharded family)."""

    def release(self) -> None:
        """The round's groups go; the gradient buckets stay for the next round (a re-form
        that allocated them anew cost the survivors one model's worth of zero-filled
        memory and its page faults in every restore: 133 MB and 0.1 s at 33M parameters)."""
        if self.stepper is not None:
            self.stepper.release_group()
