"""How an agent ends, as a typed value: the only place an exit code comes from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Finished:
    """The job completed (here or on another node); the agent exits 0."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The job stopped on an error it could not absorb; the agent exits 1."""

    reason: str


@dataclass(frozen=True, slots=True)
class Left:
    """The node left: on a signal (it exits 128 + the signal, as a shell would) or on a
    preemption notice (it exits 0, its job done as asked)."""

    signum: int | None
    step: int | None = None
    """The step after which its workers left at a boundary; None: they were stopped."""
    source: str = ""
    """What asked it to leave (``SIGTERM``, a notice URL, ``file:...``)."""
    why: str = ""
    """Why it left at once rather than at a boundary, when it did."""


Outcome = Finished | Failed | Left

_FAILED_RECORD = "failed"


def closed_record(outcome: Finished | Failed) -> str:
    """The text stored under the run's ``closed`` key (shown by ``elastic-rt status``)."""
    if isinstance(outcome, Failed):
        return f"{_FAILED_RECORD}: {outcome.reason}"
    return outcome.reason


def closed_outcome(record: str) -> Finished | Failed:
    """Read back a ``closed`` record that any node may have written; inverse of
    :func:`closed_record`. The one place the stored text is interpreted."""
    kind, _, reason = record.partition(": ")
    return Failed(reason) if kind == _FAILED_RECORD else Finished(record)


def exit_code(outcome: Outcome) -> int:
    if isinstance(outcome, Left):
        return 0 if outcome.signum is None else 128 + outcome.signum
    return 1 if isinstance(outcome, Failed) else 0
