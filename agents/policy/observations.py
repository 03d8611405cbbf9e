"""What the policy is told: the loop's look at the run and the workers, and what each
action it decided turned out to do.

An action whose result matters to the next decision (were the workers started? did
this node claim the failure?) comes back as one of these, and :func:`decide` takes it
like any other observation: the agent and the simulators never change the state
themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.policy.outcomes import Failed
from agents.worker_state import WorkerExit, WorkerState
from elastic_rt.rendezvous.rounds import Round, Snapshot
from elastic_rt.root_cause import RootCause


@dataclass(frozen=True, slots=True)
class LeaveNotice:
    """The node is to leave soon: SIGTERM or SIGINT (Kubernetes, Slurm, Ctrl-C) or a
    preemption notice (``--preemption-notice``, see :mod:`agents.preemption`).

    The node leaves at its workers' next step boundary when they recover in place (nothing
    is redone; the others pause for one re-form), else at once.
    """

    source: str
    """What gave it: ``SIGTERM``, the notice URL, ``file:PATH``, ``cmd:COMMAND``."""
    detail: str = ""
    """What the source said (a body, a file's first line), for the events."""
    deadline_ms: int | None = None
    """When the source says the node goes (wall clock), if it says."""
    signum: int | None = None
    """The signal that gave it; the agent then exits 128 + it."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the agent saw this time round its loop."""

    now: float
    """Monotonic seconds."""
    now_ms: int = 0
    """Wall-clock milliseconds, stamped on rounds this node proposes."""
    snapshot: Snapshot | None = None
    """The run as just read; None when it was not re-read (see :func:`should_read`)."""
    store_error: bool = False
    """The read failed: etcd did not answer."""
    workers: WorkerState = WorkerState.IDLE
    exits: tuple[WorkerExit, ...] = ()
    acks: tuple[int | None, ...] = ()
    """Per local worker: the round it acknowledged as an in-process worker, or None."""
    waited: float = 0.0
    """Seconds since the agent started, for the join timeout."""
    leave_signal: int | None = None
    """Leave at once (a signal, or a second one after a signal's notice)."""
    notice: LeaveNotice | None = None
    """Leave at the workers' next step boundary (the first notice taken)."""
    left: tuple[int | None, ...] = ()
    """Per local worker: the step after which it left at a boundary, or None."""


@dataclass(frozen=True, slots=True)
class Fenced:
    """The lease thread could not renew the lease and stopped the workers."""


@dataclass(frozen=True, slots=True)
class WorkersStarted:
    """The round's store was agreed and the workers started in ``round``."""

    round: Round


@dataclass(frozen=True, slots=True)
class RoundFollowed:
    """The round's store was agreed; the in-process workers re-form into ``round``."""

    round: Round
    now: float


@dataclass(frozen=True, slots=True)
class JoiningInPlace:
    """The node joins a job that recovers in place (see :func:`joins_in_standby`)."""

    round: Round
    """The run's current round, whose workers ours will join once admitted."""


@dataclass(frozen=True, slots=True)
class StandbyStarted:
    """Workers started outside any round, and had time to announce themselves."""

    round: Round
    announced: bool
    """Every worker announced in-process recovery in time."""
    registered: bool
    """The node registered on a new lease after they did."""
    exits: tuple[WorkerExit, ...] = ()
    """How the workers that ended before announcing themselves ended (none: too slow, if
    not announced). A failed one is replaced like one failing later in standby."""


@dataclass(frozen=True, slots=True)
class Registered:
    """Back from a fence, the node registered on a new lease."""


@dataclass(frozen=True, slots=True)
class RegisterFailed:
    """Registering again failed: etcd did not answer."""


@dataclass(frozen=True, slots=True)
class FailureFacts:
    """What the agent learned after a local worker failed and the workers were stopped."""

    round: Round
    """The round the failed worker ran in."""
    snapshot: Snapshot
    """The run, read after stopping the workers."""
    in_process: bool
    """The workers had announced in-process recovery."""
    first: WorkerExit
    """The first failed worker."""
    node_id: str
    now_ms: int = 0
    cause: RootCause | None = None
    """What the failed worker left in its error file, if anything."""

    @property
    def in_standby(self) -> bool:
        """The worker failed outside any round (standby workers: a spare, a node waiting
        to be admitted, replacements); no member's collective waited on it."""
        return self.round.number < 0

    @property
    def round_changed(self) -> bool:
        current = self.snapshot.round
        return current is None or current.number != self.round.number

    @property
    def what(self) -> str:
        error = f" ({self.cause.error})" if self.cause and self.cause.has_exception else ""
        return (f"worker {self.first.local_rank} on {self.node_id} exited with "
                f"{self.first.exitcode}{error}")


@dataclass(frozen=True, slots=True)
class FailureSeen:
    """A local worker failed; the workers are stopped and ``facts`` gathered."""

    facts: FailureFacts


@dataclass(frozen=True, slots=True)
class PeersProbed:
    """The members of ``round`` were probed: which are dead, which did not answer."""

    round: Round
    dead: tuple[str, ...]
    unsure: tuple[str, ...]
    look: Observation
    """The local workers as they were after the probes (no run read)."""


@dataclass(frozen=True, slots=True)
class FailureClaimed:
    """The claim on the round's failure was sent and the root cause reported."""

    claimed: bool
    """This node counts the failure (one node per round does)."""
    repeated: Failed | None
    """The root cause repeats the previous attempt's (see :func:`repeated_failure`)."""


@dataclass(frozen=True, slots=True)
class RestartCounted:
    """The claimed failure was counted as restart ``count`` of the job."""

    count: int


@dataclass(frozen=True, slots=True)
class ReformWritten:
    """``proposed`` (this node a member without ranks) was written, if it still could
    be; ``current`` is the round read after."""

    proposed: Round
    why: str
    current: Round | None
    now_ms: int


@dataclass(frozen=True, slots=True)
class LeaveWritten:
    """The round without this node was written (``written``), or not: ``current`` is the
    round read after (None when etcd did not answer)."""

    written: Round | None
    current: Round | None
    step: int
    """The step after which the workers left."""
    now: float
    now_ms: int = 0


Observed = (Observation | Fenced | WorkersStarted | RoundFollowed | JoiningInPlace
            | StandbyStarted | Registered | RegisterFailed | FailureSeen | PeersProbed
            | FailureClaimed | RestartCounted | ReformWritten | LeaveWritten)
