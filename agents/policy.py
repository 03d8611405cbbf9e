"""What a node's agent does next, as pure decisions over values.

The agent (``agents/agent.py``) observes (a snapshot of the run, its workers' state,
their acknowledgements, the clock) and calls :func:`decide`, which answers with the
node's next :class:`AgentState` and the actions to carry out, in order. The
simulated nodes of the rendezvous tests and benchmark (``agents/sim/simulated.py``)
run the same function with no workers. Like :mod:`elastic_rt.rendezvous.rounds`,
nothing here sleeps, reads a clock, touches etcd or starts a process, so every
rule is a unit test (tests/unit/test_agent_policy.py).

A worker failure needs facts that cost I/O to learn (a fresh snapshot, probes of
the peers, a claim on the failure, the restart count), so it is decided in two
steps, :func:`on_worker_failure` and :func:`on_restart_counted`, with the agent
doing the I/O in between. How the process ends is a typed :data:`Outcome`, and
:func:`exit_code` is the only place an exit code comes from.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from datetime import timedelta

from agents.worker_state import WorkerExit, WorkerState
from elastic_rt.config import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_REFORM_TIMEOUT,
)
from elastic_rt.rendezvous import rounds
from elastic_rt.rendezvous.rounds import Limits, Propose, Round, Snapshot, restart_round
from elastic_rt.root_cause import RootCause


# outcomes --------------------------------------------------------------------------
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
    """The node left on a signal; the agent exits 128 + the signal, as a shell would."""

    signum: int


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
        return 128 + outcome.signum
    return 1 if isinstance(outcome, Failed) else 0


# state -----------------------------------------------------------------------------
class Phase(enum.Enum):
    IDLE = "idle"
    """No workers: before the first round, or after stopping them."""
    RUNNING = "running"
    """Workers run in ``state.round``."""
    REFORMING = "reforming"
    """In-process workers are joining ``state.round``, until ``state.ack_deadline``."""
    STANDBY = "standby"
    """In-process workers started outside any round wait to be admitted;
    ``state.round`` is the round they will join, numbered -1 (they are in none)."""
    FENCED = "fenced"
    """The lease was lost and the workers stopped; ``state.round`` is the round the
    node was cut from (None if it had none). Until ``state.registered`` the node is
    not registered again (see :class:`RejoinInStandby`)."""


@dataclass(frozen=True, slots=True)
class AgentState:
    """Everything the agent remembers between two decisions."""

    phase: Phase = Phase.IDLE
    round: Round | None = None
    ack_deadline: float = 0.0
    """Monotonic time by which REFORMING workers must acknowledge ``round``."""
    restart_count: int = 0
    """Times this node started its workers again (torchrun's restart count)."""
    ever_ran: bool = False
    quorum_since: float | None = None
    """When the first round's last call started (see :func:`rounds.decide`)."""
    alarm_seen: int = 0
    """Revision of the last worker alarm answered."""
    in_process_published: bool = False
    registered: bool = True
    """False from a fence until the node registers on a new lease."""

    @property
    def running(self) -> Round | None:
        """The round this node's workers belong to (or wait for, in standby)."""
        return self.round if self.phase in _WITH_WORKERS else None


_WITH_WORKERS = (Phase.RUNNING, Phase.REFORMING, Phase.STANDBY)


def started(state: AgentState, round_: Round) -> AgentState:
    """Workers started afresh in ``round_``: a restart unless they are the first."""
    return dataclasses.replace(
        state, phase=Phase.RUNNING, round=round_, ever_ran=True,
        restart_count=state.restart_count + (1 if state.ever_ran else 0),
    )  # fmt: skip


def following(state: AgentState, round_: Round, *, now: float, reform_timeout: timedelta
              ) -> AgentState:
    """In-process workers re-form into ``round_`` by themselves; wait for their acks."""
    return dataclasses.replace(
        state, phase=Phase.REFORMING, round=round_,
        ack_deadline=now + reform_timeout.total_seconds(),
    )  # fmt: skip


def standby_started(state: AgentState, *, restart: bool) -> AgentState:
    """Workers started outside any round; ``restart`` when they replace failed ones."""
    return dataclasses.replace(
        state, ever_ran=True, restart_count=state.restart_count + (1 if restart else 0)
    )


def in_standby(state: AgentState, round_: Round) -> AgentState:
    """The standby workers announced themselves; wait to be admitted to a round."""
    return dataclasses.replace(
        state, phase=Phase.STANDBY, round=dataclasses.replace(round_, number=-1)
    )


def stopped(state: AgentState) -> AgentState:
    return dataclasses.replace(state, phase=Phase.IDLE, round=None)


def fenced(state: AgentState) -> AgentState:
    """The lease thread stopped the workers: remember the round to rejoin."""
    if state.phase is Phase.FENCED:
        # fenced again before rejoining: still the same round to rejoin
        return dataclasses.replace(state, registered=False)
    return dataclasses.replace(state, phase=Phase.FENCED, round=state.running, registered=False)


def registered(state: AgentState) -> AgentState:
    """A fenced node registered on a new lease; its workers start with the next round."""
    return dataclasses.replace(state, registered=True)


# observations and settings ------------------------------------------------------------
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


@dataclass(frozen=True, slots=True)
class Settings:
    """The node's fixed rules: limits, timings and the restart budget."""

    node_id: str
    limits: Limits
    monitor_interval: timedelta = DEFAULT_MONITOR_INTERVAL
    """Between two looks at the workers."""
    wait_poll: timedelta = timedelta(seconds=0.5)
    """Between two reads while waiting for a round."""
    reread_every: timedelta = timedelta(seconds=1)
    """At least this often the run is re-read while nothing wakes the agent."""
    retry_after: timedelta = timedelta(seconds=0.5)
    """After etcd did not answer."""
    join_timeout: timedelta = timedelta.max
    reform_timeout: timedelta = DEFAULT_REFORM_TIMEOUT
    max_restarts: int = DEFAULT_MAX_RESTARTS
    nproc: int = 1
    """Workers this node runs (the ranks it asks back after its workers are replaced)."""


def acks_in_process(acks: tuple[int | None, ...]) -> bool:
    """Every local worker (alive or not) has announced in-process recovery."""
    return bool(acks) and all(a is not None for a in acks)


def _joined(acks: tuple[int | None, ...], number: int) -> bool:
    return all(a is not None and a >= number for a in acks)


def _follow(obs: Observation) -> bool:
    """Every local worker is alive and recovers in-process.

    A dead worker's ack file outlives it. Following the round with it would make
    the new round wait for a rank that never comes (and when that rank is 0, hosts
    its store), so a node with a dead worker restarts instead.
    """
    return obs.workers is WorkerState.RUNNING and acks_in_process(obs.acks)


# actions ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProposeRound:
    """Write ``proposal``; ``replaced`` is the round it replaces (for node.lost events)."""

    proposal: Propose
    replaced: Round | None = None


@dataclass(frozen=True, slots=True)
class StartWorkers:
    """Agree on the round's store address, then start the workers in ``round``."""

    round: Round


@dataclass(frozen=True, slots=True)
class FollowRound:
    """Agree on the round's store address; in-process workers re-form by themselves."""

    round: Round


@dataclass(frozen=True, slots=True)
class RejoinInStandby:
    """Back from a fence in a job that recovers in place: come back like a new node.

    What is left of the old lease is revoked (the survivors re-form without us at once,
    if they have not yet), the workers start in standby, and the node registers only
    once they are imported. Registering first would get us admitted while our workers
    are still starting, and every survivor would wait for them (3.6-4.3 s measured).
    """

    round: Round
    """The run's current round, whose workers ours will join once admitted."""


@dataclass(frozen=True, slots=True)
class Register:
    """Back from a fence in restart mode: register on a new lease; the next round that
    lists us starts our workers."""


@dataclass(frozen=True, slots=True)
class StopWorkers:
    why: str


@dataclass(frozen=True, slots=True)
class HandleFailure:
    """A local worker failed in ``round``: see :func:`on_worker_failure`."""

    round: Round
    exits: tuple[WorkerExit, ...]


@dataclass(frozen=True, slots=True)
class Succeed:
    """Every local worker succeeded: mark the job completing and leave."""

    round: Round | None


@dataclass(frozen=True, slots=True)
class AnswerAlarm:
    """A collective failed in ``round``: probe the peers (see :func:`alarm_verdict`)."""

    round: Round


@dataclass(frozen=True, slots=True)
class PublishInProcess:
    """Tell nodes that join later that this run's workers recover in place."""


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


Action = (ProposeRound | StartWorkers | FollowRound | StopWorkers | HandleFailure | Succeed
          | AnswerAlarm | PublishInProcess | CloseRun | Exit | JoinTimedOut | Sleep
          | RejoinInStandby | Register)


@dataclass(frozen=True, slots=True)
class Decision:
    state: AgentState
    actions: tuple[Action, ...]
    rendezvous: rounds.Action | None = None
    """The round decision this one acted on (None when the run was not re-read)."""


# the loop's decision -------------------------------------------------------------------
def should_read(state: AgentState, *, dirty: bool, since_read: float, settings: Settings) -> bool:
    """Re-read the run only on a change, at least every ``reread_every``, or when not settled.

    Checking local workers every monitor interval costs nothing; reading the whole
    run from etcd that often would, for every node of a large job.
    """
    if dirty or state.phase is not Phase.RUNNING:
        return True
    return since_read >= settings.reread_every.total_seconds()


def decide(state: AgentState, obs: Observation, settings: Settings) -> Decision:
    """What the agent does next. Pure."""
    if obs.leave_signal is not None:
        return Decision(state, (Exit(Left(obs.leave_signal)),))
    if obs.store_error:
        return Decision(state, (Sleep(settings.retry_after.total_seconds()),))
    snapshot = obs.snapshot
    if snapshot is None:
        assert state.round is not None, "the run is re-read while not in a round"
        return participate(state, state.round, obs, settings)
    if snapshot.completing and finished_without_us(state, snapshot, obs, settings.node_id):
        return Decision(state, (
            CloseRun(Finished("finished")),
            Exit(Finished("finished: the job completed before this node's workers joined")),
        ))  # fmt: skip
    action = rounds.decide(snapshot, settings.node_id, settings.limits, now=obs.now,
                           quorum_since=state.quorum_since, now_ms=obs.now_ms)
    if isinstance(action, rounds.Closed):
        return Decision(state, (Exit(closed_outcome(action.reason)),), action)
    if state.phase is Phase.FENCED and not state.registered:
        rejoin: Action = (RejoinInStandby(snapshot.round)
                          if snapshot.round is not None and joins_in_standby(snapshot)
                          else Register())
        return Decision(state, (rejoin,), action)
    if isinstance(action, rounds.Propose):
        return Decision(state, (ProposeRound(action, replaced=snapshot.round),), action)
    if isinstance(action, rounds.Wait):
        return dataclasses.replace(_wait(state, action, obs, settings, len(snapshot.nodes)),
                                   rendezvous=action)
    grow = _grow_back(state, action.round, obs, settings, snapshot)
    if grow is not None:
        return Decision(state, (grow,), action)
    if snapshot.alarm and snapshot.alarm[1] > state.alarm_seen:
        state = dataclasses.replace(state, alarm_seen=snapshot.alarm[1])
        if snapshot.alarm[0] == action.round.number:
            return Decision(state, (AnswerAlarm(action.round),), action)
    return dataclasses.replace(participate(state, action.round, obs, settings), rendezvous=action)


def _grow_back(state: AgentState, round_: Round, obs: Observation, settings: Settings,
               snapshot: Snapshot) -> ProposeRound | None:
    """Our workers are back after a replacement (see :class:`ReplaceWorkers`): ask for
    the ranks the round took from this node.

    With standby workers that have announced themselves they join at the survivors'
    next step boundary; with none (they did not start in time), the round restarts ours.
    """
    me = settings.node_id
    if snapshot.completing or round_.nprocs[round_.group_rank(me)] >= settings.nproc:
        return None
    ready = state.phase is Phase.STANDBY and _follow(obs)
    idle = state.phase is Phase.IDLE and obs.workers is WorkerState.IDLE
    if not (ready or idle):
        return None
    return ProposeRound(with_ranks(round_, me, settings.nproc, f"{me}'s workers are back",
                                   obs.now_ms))


def with_ranks(round_: Round, node_id: str, nproc: int, reason: str, now_ms: int) -> Propose:
    """The same members in a new round, with ``node_id`` contributing ``nproc`` ranks."""
    nprocs = list(round_.nprocs)
    nprocs[round_.group_rank(node_id)] = nproc
    proposal = restart_round(round_, reason, now_ms)
    return dataclasses.replace(proposal,
                               round=dataclasses.replace(proposal.round, nprocs=tuple(nprocs)))


def _wait(state: AgentState, action: rounds.Wait, obs: Observation, settings: Settings,
          registered: int) -> Decision:
    state = dataclasses.replace(state, quorum_since=action.quorum_since)
    actions: list[Action] = []
    if (action.stop_workers or state.running is not None) and state.phase is not Phase.STANDBY:
        actions.append(StopWorkers(f"waiting: {action.reason}"))
        state = stopped(state)
    if not state.ever_ran and obs.waited > settings.join_timeout.total_seconds():
        actions.append(JoinTimedOut(registered))
    actions.append(Sleep(settings.wait_poll.total_seconds(), waiting_for=action.reason))
    return Decision(state, tuple(actions))


def participate(state: AgentState, round_: Round, obs: Observation, settings: Settings
                ) -> Decision:
    """Run (or keep running) this node's workers in ``round_``."""
    if state.phase is Phase.FENCED:
        # We stopped our workers while cut off; everyone restarts in a new round.
        cut_from, state = state.round, stopped(state)
        if cut_from is not None and cut_from.number == round_.number:
            why = f"{settings.node_id} rejoined"
            return Decision(state, (ProposeRound(restart_round(round_, why, obs.now_ms)),))
    current = state.running
    if current is None or current.number != round_.number:
        if current is not None and obs.workers is WorkerState.FAILED:
            # Our own worker died as the round changed: a failure, not a re-form.
            return Decision(state, (HandleFailure(current, obs.exits),))
        if current is not None and obs.workers is WorkerState.SUCCEEDED:
            return Decision(state, (Succeed(current),))  # done as a node was admitted
        if current is not None and _follow(obs):
            return Decision(state, (FollowRound(round_),))
        if current is not None:
            return Decision(stopped(state), (StopWorkers(f"round {round_.number} formed"),
                                             StartWorkers(round_)))
        return Decision(state, (StartWorkers(round_),))
    actions: list[Action] = []
    running = obs.workers is WorkerState.RUNNING
    if state.phase is Phase.REFORMING and running:
        if _joined(obs.acks, round_.number):
            state = dataclasses.replace(state, phase=Phase.RUNNING)
        elif obs.now > state.ack_deadline:
            # Restart mode is the fallback, never a hang.
            return Decision(stopped(state), (StopWorkers("in-process re-form timed out"),
                                             Sleep(settings.monitor_interval.total_seconds())))
    if not state.in_process_published and running and acks_in_process(obs.acks):
        state = dataclasses.replace(state, in_process_published=True)
        actions.append(PublishInProcess())
    if obs.workers is WorkerState.SUCCEEDED:
        actions.append(Succeed(state.running))
    elif obs.workers is WorkerState.FAILED:
        actions.append(HandleFailure(round_, obs.exits))
    else:
        actions.append(Sleep(settings.monitor_interval.total_seconds()))
    return Decision(state, tuple(actions))


def finished_without_us(state: AgentState, snapshot: Snapshot, obs: Observation, me: str
                        ) -> bool:
    """The job completed in a round that lists us, and every other member has left.

    Seen when a node is admitted just as the others finish their last step: its
    workers would wait for a round store that is gone. It applies when we have no
    workers, or in-process workers that never joined the round (their acks say so);
    a worker that did join may still be writing its outputs, so it is never cut short.
    """
    round_ = snapshot.round
    if round_ is None or me not in round_.members or not snapshot.nodes_known:
        return False  # a follower cannot tell who left; the leader's rounds will
    if any(m in snapshot.nodes for m in round_.members if m != me):
        return False
    if obs.workers is not WorkerState.RUNNING:
        return state.running is None and obs.workers is WorkerState.IDLE
    if not acks_in_process(obs.acks):
        return False
    return not any(a is not None and a >= round_.number for a in obs.acks)


# joining, alarms and failures ------------------------------------------------------------
def is_stale_run(snapshot: Snapshot) -> bool:
    """A finished run with nobody left: a new launch with the same id starts afresh."""
    return ((snapshot.closed is not None or snapshot.completing) and snapshot.nodes_known
            and not snapshot.nodes)


def joins_in_standby(snapshot: Snapshot) -> bool:
    """(Re)joining a job that recovers in place: start the workers before registering.

    Admitting us before our workers have imported torch would make every survivor
    wait for them. This holds for a new node, for one back from a fence
    (:class:`RejoinInStandby`) and for one that restarted (the round may still list
    it, and hold its old registration, which the agent revokes first).
    """
    return (snapshot.in_process and snapshot.round is not None
            and not (snapshot.closed or snapshot.completing))


class AlarmVerdict(enum.Enum):
    HANDLED = "handled"
    """Membership changed (dead peers evicted) or a re-form round is to be proposed."""
    CARRY_ON = "carry on"
    """A hung peer (its lease decides) or our own dead worker (handled next)."""


def alarm_verdict(round_: Round, *, dead: list[str], unsure: list[str], workers: WorkerState,
                  now_ms: int) -> tuple[AlarmVerdict, ProposeRound | None]:
    """After probing the peers of ``round_``: evict the dead, or re-form if all answer.

    A peer that neither answers nor refuses (hung) is left to its lease.
    """
    if dead:
        return AlarmVerdict.HANDLED, None
    if unsure or workers is WorkerState.FAILED:
        return AlarmVerdict.CARRY_ON, None
    proposal = restart_round(round_, "a collective failed; all nodes answer", now_ms)
    return AlarmVerdict.HANDLED, ProposeRound(proposal)


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
    def round_changed(self) -> bool:
        current = self.snapshot.round
        return current is None or current.number != self.round.number

    @property
    def what(self) -> str:
        error = f" ({self.cause.error})" if self.cause and self.cause.has_exception else ""
        return (f"worker {self.first.local_rank} on {self.node_id} exited with "
                f"{self.first.exitcode}{error}")


class FailureStep(enum.Enum):
    IGNORE = "ignore"
    """A membership change took our workers down: free, and handled by the next round."""
    PROBE = "probe"
    """Probe the peers: a dead one explains the failure (free); else claim it."""
    CLAIM = "claim"
    """Claim the failure for this round (one node per round) and count a restart."""


def on_worker_failure(facts: FailureFacts) -> FailureStep | Failed:
    """The first step after a local worker failed; a :class:`Failed` closes the run."""
    if facts.snapshot.closed is not None:
        # A worker closed the run before exiting (an error in the user's code): the job
        # is over on every node; restarting here would only repeat the error.
        closed = closed_outcome(facts.snapshot.closed)
        return closed if isinstance(closed, Failed) else Failed(closed.reason)
    if facts.snapshot.completing:
        return Failed(f"a worker exited with {facts.first.exitcode} while the job was finishing")
    if facts.round_changed and not facts.in_process:
        return FailureStep.IGNORE
    return FailureStep.CLAIM if facts.round_changed else FailureStep.PROBE


@dataclass(frozen=True, slots=True)
class RestartInStandby:
    """Step out of ``round`` while the failed in-process worker is replaced.

    A restart round with the same members would make the survivors wait for the
    replacement to start (seconds of importing torch); instead the lease goes at
    once, the survivors re-form without this node, and the replacements start in
    standby and ask to be let back in.
    """

    round: Round
    why: str


@dataclass(frozen=True, slots=True)
class ReplaceWorkers:
    """At the minimum node count, replace the failed in-process workers without waiting.

    Stepping out (:class:`RestartInStandby`) would leave too few nodes, and a restart
    round would make the survivors wait seconds for the replacements (8.5-12 s
    measured). Instead ``proposal`` keeps this node a member with no ranks, so the
    survivors re-form at once without its workers; the replacements start in standby
    under the node's lease, and once imported the node asks for its ranks back
    (:func:`_grow_back`).

    Note: the node's other local workers are replaced too (they were stopped with the
    failed one), so a node of several workers contributes none meanwhile, not one fewer.
    """

    proposal: ProposeRound
    why: str


def on_restart_counted(facts: FailureFacts, count: int, settings: Settings
                       ) -> Failed | RestartInStandby | ReplaceWorkers | ProposeRound | None:
    """The failure was claimed and counted as restart ``count`` of the job.

    A :class:`Failed` closes the run (the node that spent the budget says why, like
    its peers); None: the round already changed, so the next one restarts us.
    """
    if count > settings.max_restarts:
        return Failed(f"{facts.what}; the restart budget of {settings.max_restarts} is spent")
    why = f"{facts.what} (restart {count}/{settings.max_restarts})"
    current = facts.snapshot.round or facts.round
    if facts.in_process and len(current.members) > settings.limits.min_nodes:
        return RestartInStandby(current, why)
    if facts.in_process and facts.node_id in current.members:
        # Also when a peer's alarm already restarted the round with our ranks in it: the
        # survivors would wait in it for workers we have not started.
        without = with_ranks(current, facts.node_id, 0, why, facts.now_ms)
        return ReplaceWorkers(ProposeRound(without, replaced=current), why)
    if not facts.round_changed:
        return ProposeRound(restart_round(facts.round, why, facts.now_ms))
    return None


# root causes -------------------------------------------------------------------------------
def should_report(cause: RootCause, *, claimed: bool) -> bool:
    """Report our failure as the root cause: it raised, or we counted the round's failure.

    A failure that a membership change explains is never reported: the worker's
    "connection closed" is not a root cause, and would look deterministic next time.
    """
    return claimed or cause.has_exception


def supersedes(new: RootCause, old: RootCause | None) -> bool:
    """``new`` replaces the stored root cause: it is from a later round, or from the same
    round and it carries the exception where the stored one only had an exit code."""
    if old is None or old.round < new.round:
        return True
    return old.round == new.round and new.has_exception and not old.has_exception


def repeated_failure(new: RootCause, previous: RootCause | None) -> Failed | None:
    """The same exception, raised at the same place and step, after a restart: the error is
    deterministic, so a second restart would only repeat it (it is retried at most once).

    A script error before any completed step has step None both times, so it counts too.
    Failures without an exception (a signal, an exit code) are never judged repeated: an
    OOM kill or a lost host may well pass.
    """
    if previous is None or previous.round >= new.round:
        return None
    if not (new.has_exception and previous.has_exception) or new.signature != previous.signature:
        return None
    return Failed(f"{new.summary()}; the same failure ended the previous attempt, so it is "
                  "not retried again")
