"""What the policy asks the agent to do, in order, and the decision that carries it.

Each action is one piece of I/O. Those whose outcome the next decision needs return
an observation (see observations.py): :class:`StartWorkers` -> ``WorkersStarted``,
:class:`StartInStandby` -> ``StandbyStarted``, :class:`HandleFailure` -> ``FailureSeen``,
and so on. :mod:`agents.dispatch` is the one place that maps an action to the calls
that carry it out, for the agent and the simulators alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.policy.observations import LeaveNotice
from agents.policy.outcomes import Failed, Finished, Outcome
from agents.policy.state import AgentState
from agents.worker_state import WorkerExit
from elastic_rt.rendezvous import rounds
from elastic_rt.rendezvous.rounds import Propose, Round
from elastic_rt.root_cause import RootCause


# rounds ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProposeRound:
    """Write ``proposal``; ``replaced`` is the round it replaces (for node.lost events)."""

    proposal: Propose
    replaced: Round | None = None


@dataclass(frozen=True, slots=True)
class StartWorkers:
    """Agree on the round's store address, then start the workers in ``round``
    (-> ``WorkersStarted``; nothing when the round has no store). Their
    ``TORCHELASTIC_RESTART_COUNT`` is ``round.restarts``."""

    round: Round
    first: bool
    """No workers ran on this node before (worker.started, not worker.restarted)."""


@dataclass(frozen=True, slots=True)
class FollowRound:
    """Agree on the round's store address; in-process workers re-form by themselves
    (-> ``RoundFollowed``; nothing when the round has no store)."""

    round: Round


@dataclass(frozen=True, slots=True)
class StopWorkers:
    why: str
    grace: bool = True
    """SIGTERM and the grace period first. False when a peer of theirs is gone: their
    collectives can only fail, and a framework's SIGTERM handler (Lightning's runs a
    broadcast on the broken group) would only wait out the grace period."""


@dataclass(frozen=True, slots=True)
class PublishInProcess:
    """Tell nodes that join later that this run's workers recover in place."""


# (re)joining -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StartInStandby:
    """Start workers outside any round, and register only once they are imported
    (-> ``StandbyStarted``).

    Used by a node joining a running in-process job, by one replacing a failed worker
    and by one back from a fence. Registering first would get us admitted while our
    workers are still starting, and every survivor would wait for them (3.6-4.3 s
    measured). Without ``register`` (the node stayed a member without ranks) it asks
    for its ranks back once they are up. Workers that do not announce themselves in
    time are stopped and the node joins the normal way (restart mode is the
    fallback, never a hang).
    """

    round: Round
    """The round whose workers ours will join once admitted."""
    restart_count: int
    """The job's failure count (see :attr:`Round.restarts`), one more than ``round``'s
    when these workers replace failed ones."""
    first: bool
    """No workers ran on this node before (worker.started, not worker.restarted)."""
    register: bool


@dataclass(frozen=True, slots=True)
class RevokeLostLease:
    """Back from a fence: end what is left of the old lease, so the survivors re-form
    without this node now rather than when it expires."""


@dataclass(frozen=True, slots=True)
class Unregister:
    """Drop this node's registration (revoke its lease) without leaving the job: a spare
    or a node waiting to be admitted whose standby worker died, so that no round admits
    it while the replacement imports torch (every member would wait for it)."""

    why: str


@dataclass(frozen=True, slots=True)
class Register:
    """Back from a fence in restart mode: register on a new lease (-> ``Registered``
    or ``RegisterFailed``); the next round that lists us starts our workers."""


# failures and alarms -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HandleFailure:
    """A local worker failed in ``round``: report it, stop the workers, gather the facts
    (-> ``FailureSeen``)."""

    round: Round
    exits: tuple[WorkerExit, ...]


@dataclass(frozen=True, slots=True)
class ProbePeers:
    """Probe the members of ``round`` (-> ``PeersProbed``): after a worker's alarm (a
    collective failed) or a local failure, a dead peer explains it."""

    round: Round


@dataclass(frozen=True, slots=True)
class ClaimFailure:
    """Claim ``round``'s failure (one node per round counts it) and report its root
    cause (-> ``FailureClaimed``)."""

    round: Round
    what: str
    cause: RootCause | None


@dataclass(frozen=True, slots=True)
class CountRestart:
    """Count the claimed failure against the job's restart budget (-> ``RestartCounted``)."""


@dataclass(frozen=True, slots=True)
class ReportRootCause:
    """Store ``cause`` as the run's root cause where it supersedes the stored one."""

    cause: RootCause


@dataclass(frozen=True, slots=True)
class LeaveRound:
    """Revoke the lease at once and say so: the survivors re-form without us now."""

    round: Round
    why: str


@dataclass(frozen=True, slots=True)
class ReformWithoutUs:
    """Write ``proposal`` (this node a member with no ranks), then read the round back
    (-> ``ReformWritten``): a peer's alarm may have written one with our ranks."""

    proposal: ProposeRound
    why: str


# leaving at a step boundary -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AnnounceLeave:
    """Say that this node leaves: to its workers when ``at_boundary`` (they leave after
    their next step, all ranks at the same one), to the run (``elastic-rt status``) and in
    the events (``node.preempting``)."""

    notice: LeaveNotice
    deadline_ms: int
    """Wall clock: when the node leaves at once if no boundary came first."""
    at_boundary: bool


@dataclass(frozen=True, slots=True)
class LeaveAtBoundary:
    """The workers left after ``step``: write ``proposal`` (the round without this node)
    and drop the node's registration, in one transaction (-> ``LeaveWritten``)."""

    proposal: Propose
    step: int


# the end -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Succeed:
    """Every local worker succeeded: mark the job completing and leave."""

    round: Round | None


@dataclass(frozen=True, slots=True)
class CloseRun:
    """Close the run for everyone with ``outcome``."""

    outcome: Finished | Failed


@dataclass(frozen=True, slots=True)
class Exit:
    """Stop the workers and end the agent with ``outcome``."""

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class JoinTimedOut:
    """Too few nodes joined in time: a user-facing error."""

    registered: int


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait this long, or until something wakes the agent."""

    seconds: float
    waiting_for: str = ""
    """Why no round could be joined, when that is the reason to wait."""


Action = (ProposeRound | StartWorkers | FollowRound | StopWorkers | PublishInProcess
          | StartInStandby | RevokeLostLease | Unregister | Register | HandleFailure | ProbePeers
          | ClaimFailure | CountRestart | ReportRootCause | LeaveRound | ReformWithoutUs
          | AnnounceLeave | LeaveAtBoundary | Succeed | CloseRun | Exit | JoinTimedOut | Sleep)


@dataclass(frozen=True, slots=True)
class Decision:
    state: AgentState
    actions: tuple[Action, ...]
    rendezvous: rounds.Action | None = None
    """The round decision this one acted on (None when the run was not re-read)."""
