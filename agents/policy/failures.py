"""Settling a local worker's failure, and a worker's alarm: what it costs the job.

The rules: a membership change that took our workers down is free (the next round
handles it), and so is a failure a dead peer explains; otherwise one node per round
claims the failure and counts it against the job's restart budget, and a spent budget
or the same exception twice closes the run for everyone. A standby worker's failure
(outside any round) disturbs no member: it is counted at once and the worker replaced
in standby. The facts cost I/O (a fresh
snapshot, probes of the peers, the claim, the count), so settling is a phase of
:func:`agents.policy.decide`: each fact comes back as an observation and the state
stays SETTLING, holding what was learned, until the failure is settled.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from agents.policy.actions import (
    Action,
    ClaimFailure,
    CloseRun,
    CountRestart,
    Decision,
    Exit,
    LeaveRound,
    ProbePeers,
    ProposeRound,
    ReformWithoutUs,
    ReportRootCause,
    StartInStandby,
    Unregister,
)
from agents.policy.observations import (
    FailureClaimed,
    FailureFacts,
    FailureSeen,
    PeersProbed,
    ReformWritten,
    RestartCounted,
)
from agents.policy.outcomes import Failed, Finished, closed_outcome
from agents.policy.running import participate, stopped, with_ranks
from agents.policy.state import AgentState, Phase, Settings
from agents.worker_state import WorkerState
from elastic_rt.rendezvous.rounds import Round, restart_round
from elastic_rt.root_cause import RootCause


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
    (``running._grow_back``).

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
        without = with_ranks(current, facts.node_id, 0, why, facts.now_ms, restarts=count)
        return ReplaceWorkers(ProposeRound(without, replaced=current), why)
    if not facts.round_changed:
        return ProposeRound(restart_round(facts.round, why, facts.now_ms, restarts=count))
    return None


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


# the phase, one observation at a time --------------------------------------------------
def _close(state: AgentState, failed: Failed) -> Decision:
    return Decision(stopped(state), (CloseRun(failed), Exit(failed)))


def on_failure_seen(state: AgentState, obs: FailureSeen) -> Decision:
    facts = obs.facts
    if facts.in_standby and facts.snapshot.closed is None:
        return _standby_failed(state, facts)
    step = on_worker_failure(facts)
    if isinstance(step, Failed):
        closing = _close(state, step)
        if facts.cause is None:
            return closing
        # The user's error closed the run: its root cause is reported all the same.
        return dataclasses.replace(closing, actions=(ReportRootCause(facts.cause),
                                                     *closing.actions))
    if step is FailureStep.IGNORE:
        return Decision(stopped(state), ())
    settling = dataclasses.replace(stopped(state), phase=Phase.SETTLING, failure=facts)
    if step is FailureStep.PROBE:
        return Decision(settling, (ProbePeers(facts.round),))
    return Decision(settling, (ClaimFailure(facts.round, facts.what, facts.cause),))


def on_peers_probed(state: AgentState, obs: PeersProbed, settings: Settings) -> Decision:
    facts = state.failure
    if state.phase is Phase.SETTLING and facts is not None:
        if obs.dead:
            return Decision(stopped(state), ())  # a dead peer explains it: free
        return Decision(state, (ClaimFailure(facts.round, facts.what, facts.cause),))
    # A worker's alarm: evict dead peers, or re-form if all answer.
    verdict, proposal = alarm_verdict(obs.round, dead=list(obs.dead), unsure=list(obs.unsure),
                                      workers=obs.look.workers, now_ms=obs.look.now_ms)
    if verdict is AlarmVerdict.HANDLED:
        return Decision(state, (proposal,) if proposal is not None else ())
    return participate(state, obs.round, obs.look, settings)


def on_failure_claimed(state: AgentState, obs: FailureClaimed) -> Decision:
    if obs.repeated is not None:
        return _close(state, obs.repeated)
    if not obs.claimed:
        return Decision(stopped(state), ())  # another node of this round counts it
    return Decision(state, (CountRestart(),))


def on_counted(state: AgentState, obs: RestartCounted, settings: Settings) -> Decision:
    assert state.failure is not None, "a restart is counted only while settling a failure"
    if state.failure.in_standby:
        return _standby_counted(state, state.failure, obs.count, settings)
    verdict = on_restart_counted(state.failure, obs.count, settings)
    if isinstance(verdict, Failed):
        return _close(state, verdict)
    if isinstance(verdict, RestartInStandby):
        return Decision(stopped(state), (LeaveRound(verdict.round, verdict.why),
                                         _standby(state, verdict.round, obs.count,
                                                  register=True)))
    if isinstance(verdict, ReplaceWorkers):
        return Decision(state, (ReformWithoutUs(verdict.proposal, verdict.why),))
    return Decision(stopped(state), (verdict,) if verdict is not None else ())


def on_reform_written(state: AgentState, obs: ReformWritten, settings: Settings) -> Decision:
    """The round without our ranks is written; once more if a peer's alarm wrote a round
    with them meanwhile (its survivors would wait there for our replacements)."""
    actions: list[Action] = []
    current, me = obs.current, settings.node_id
    if (current is not None and me in current.members
            and current.nprocs[current.group_rank(me)] > 0):
        without = with_ranks(current, me, 0, obs.why, obs.now_ms,
                             restarts=obs.proposed.restarts)
        actions.append(ProposeRound(without, replaced=current))
    actions.append(_standby(state, obs.proposed, obs.proposed.restarts, register=False))
    return Decision(stopped(state), tuple(actions))


# a standby worker's failure ------------------------------------------------------------------
def _standby_failed(state: AgentState, facts: FailureFacts) -> Decision:
    """A worker died in standby (a spare's, a waiting node's, a replacement): no member's
    collective waited on it, so there is no round to re-form and nobody else to claim it
    with (the claim is one per round among members). It is counted at once against the
    job's restart budget, as torchrun's ``--max-restarts`` counts a restart."""
    if facts.snapshot.completing:
        return Decision(stopped(state), (Exit(Finished(
            "finished: the job completed before this node's workers joined")),))
    return Decision(dataclasses.replace(stopped(state), phase=Phase.SETTLING, failure=facts),
                    (CountRestart(),))


def _standby_counted(state: AgentState, facts: FailureFacts, count: int, settings: Settings
                     ) -> Decision:
    """Replace the standby workers, the members undisturbed: a spare or a waiting node
    drops its registration first (no round may admit it before the replacements have
    announced themselves, and it registers again then); a member without ranks (its
    replacements, at the minimum node count) keeps its lease, and asks for its ranks
    once they are up. A spent budget ends this node only, unless it is a member: then
    the job has too few nodes without it, and the run closes as for any member."""
    current = facts.snapshot.round or facts.round
    is_member = facts.node_id in current.members
    if count > settings.max_restarts:
        failed = Failed(f"{facts.what} in standby; the restart budget of "
                        f"{settings.max_restarts} is spent")
        return _close(state, failed) if is_member else Decision(stopped(state), (Exit(failed),))
    why = f"{facts.what} in standby (restart {count}/{settings.max_restarts})"
    replace = _standby(state, current, count, register=not is_member)
    return Decision(stopped(state), (replace,) if is_member else (Unregister(why), replace))


def _standby(state: AgentState, round_: Round, restarts: int, *, register: bool
             ) -> StartInStandby:
    """The failed workers' replacements, started outside any round, with the job's
    failure count ``restarts`` (this failure included)."""
    return StartInStandby(round_, restarts, first=not state.ever_ran, register=register)


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
