"""The one record that travels beside the tensors: :class:`TrainMeta`.

Rule: every path that moves a rank's state moves this record whole, through one encoding::

    capture (TrainMeta.capture) -> encode -> [checkpoint extra | replica broadcast |
        FSDP rows' piece 0 | peer-copy snapshot] -> decode -> apply (Restoring.take)

Its fields are the loop's position (``step``, ``sampler``) and what the runtime keeps of a
``TrainState`` besides its tensors (``extras``, ``scheduler``, ``runtime``: the GradScaler's
state). A new field is added here, in :meth:`TrainMeta.capture` and :meth:`TrainMeta.apply`,
and nowhere else: no trainer names a field, they carry the record.

The encoding is the checkpoint's ``extra`` JSON as it has always been laid out (keys
``step``, ``sampler``, ``extras``, ``scheduler``, ``runtime``): :meth:`TrainMeta.decode`
gives a missing key its default, so a checkpoint written before a field existed still loads.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping

from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.runtime_step import ReplicatedStep


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainMeta:
    """A rank's JSON-able state at one committed step, beside its tensors."""

    step: int
    """Committed steps the state holds."""
    sampler: dict[str, Any]
    """``ElasticSampler.state_dict()`` after ``step`` steps."""
    extras: dict[str, Any] = field(default_factory=dict)
    """The user's JSON-able extras (``TrainState.extras``, or an object's ``extras``)."""
    scheduler: dict[str, Any] | None = None
    """The LR scheduler's state dict; None without a scheduler."""
    runtime: dict[str, Any] = field(default_factory=dict)
    """The runtime's own state of the step (``ReplicatedStep.runtime_state``)."""

    @classmethod
    def capture(cls, *, step: int, sampler: ElasticSampler, state: object,
                stepper: ReplicatedStep | None = None) -> TrainMeta:
        """The record of ``state`` (a ``TrainState``, or an object owning its step) at ``step``.

        An object owning its step keeps its ``extras`` attribute, if any; a scheduler and
        runtime state only a ``TrainState`` trained by the runtime's step has.
        """
        scheduler = state.scheduler if isinstance(state, TrainState) else None
        return cls(step=step, sampler=sampler.state_dict(),
                   extras=dict(getattr(state, "extras", None) or {}),
                   scheduler=None if scheduler is None else scheduler.state_dict(),
                   runtime=stepper.runtime_state() if stepper is not None else {})

    def apply(self, *, state: object, stepper: ReplicatedStep | None = None) -> None:
        """Load what is not the loop's position into ``state`` and ``stepper``.

        An object owning its step gets nothing: it restores its own state in
        ``load_state_dict`` (its ``extras`` are saved, never loaded back).
        """
        if isinstance(state, TrainState):
            state.extras = dict(self.extras)
            if state.scheduler is not None and self.scheduler:
                state.scheduler.load_state_dict(self.scheduler)
        if stepper is not None:
            stepper.load_runtime_state(self.runtime)

    def encode(self) -> dict[str, Any]:
        """Every field by name: the checkpoint's ``extra``, and what a restore sends."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def decode(cls, data: Mapping[str, Any]) -> TrainMeta:
        """The record :meth:`encode` gave; a key it lacks (an older checkpoint) gets its
        field's default.

        Raises:
            KeyError: a field without a default (``step``, ``sampler``) is missing.
        """
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in data and data[f.name] is not None:
                values[f.name] = data[f.name]
            elif f.default is MISSING and f.default_factory is MISSING:
                raise KeyError(f"the state beside the tensors has no {f.name!r}")
        return cls(**{**values, "step": int(values["step"])})
