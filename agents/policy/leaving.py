"""Leaving on notice: at the workers' next step boundary when they can, else at once.

A node told it will go (SIGTERM, a preemption notice) that leaves at once costs the
others a failed step: their collectives break mid-step, they re-form and do the step
again. In-process workers can do better, because every rank can learn at the same step
boundary that a member leaves (``elastic_rt/worker/boundary_vote.py``): so the agent tells
its workers (:class:`AnnounceLeave`), they finish the step they are in, hand their state
over where the others need it (FSDP's shards go to peer copies of that very step), and
say which step they left after; then the agent writes the round without the node and
drops its registration in one transaction (:class:`LeaveAtBoundary`) and exits. The
others stop at that same boundary and wait only for that round: one re-form, 0 steps
redone, no failure counted.

The rules, in order: a second signal after a signal's notice leaves at once; workers that
do not recover in place (restart mode), that are not running in a round, or that failed,
leave at once (there is no boundary to wait for); past the deadline (``leave_timeout``, or
the notice's own time if sooner) the node leaves at once; workers that all left write the
round; workers that finished the job finish it (no leave). Meanwhile the node follows the
run as usual, looking at its workers every ``leave_poll``.
"""

from __future__ import annotations

import dataclasses

from agents.policy.actions import (
    Action,
    AnnounceLeave,
    Decision,
    Exit,
    LeaveAtBoundary,
    Sleep,
)
from agents.policy.observations import LeaveNotice, LeaveWritten, Observation
from agents.policy.outcomes import Left
from agents.policy import running
from agents.policy.running import acks_in_process
from agents.policy.state import AgentState, Leaving, Phase, Settings
from agents.worker_state import WorkerState
from elastic_rt.rendezvous.rounds import Round, without


def on_look(state: AgentState, obs: Observation, settings: Settings) -> Decision:
    """One turn of the loop with a notice pending (and no signal to leave at once)."""
    decided = on_notice(state, obs, settings)
    return decided if decided is not None else hurried(running.on_look(state, obs, settings),
                                                       settings)


def on_notice(state: AgentState, obs: Observation, settings: Settings) -> Decision | None:
    """The loop's look while a notice is pending; None: go on as usual (see
    :func:`hurried`), the workers have not reached their boundary yet."""
    notice = obs.notice
    assert notice is not None
    if state.leaving is None:
        return _take(state, obs, settings, notice)
    leaving = state.leaving
    step = left_step(obs.left)
    if step is not None and state.round is not None:
        return Decision(state, (_leave(state.round, step, settings, obs.now_ms, notice),))
    if obs.now >= leaving.deadline:
        by = "the notice's time" if notice.deadline_ms is not None else "the leave timeout"
        return _at_once(state, notice, f"no step boundary came before {by}")
    if obs.workers is WorkerState.FAILED:
        return _at_once(state, notice, "a worker failed while the node was leaving")
    if obs.workers is WorkerState.SUCCEEDED:
        return None  # the job finished: the workers' success is the job's (running.participate)
    if not can_leave_at_boundary(state, obs):
        return _at_once(state, notice, _why_not(state, obs))
    return None


def _take(state: AgentState, obs: Observation, settings: Settings, notice: LeaveNotice
          ) -> Decision:
    """The first look at a notice: announce it, then leave at once or wait for the boundary."""
    timeout = settings.leave_timeout.total_seconds()
    if notice.deadline_ms is not None:  # the source's own time, if it is sooner
        timeout = max(0.0, min(timeout, (notice.deadline_ms - obs.now_ms) / 1000))
    state = dataclasses.replace(state, leaving=Leaving(notice, obs.now + timeout))
    at_boundary = can_leave_at_boundary(state, obs)
    announce = AnnounceLeave(notice, obs.now_ms + int(timeout * 1000), at_boundary)
    if not at_boundary:
        return Decision(state, (announce, Exit(_left(notice, why=_why_not(state, obs)))))
    return Decision(state, (announce, Sleep(settings.leave_poll.total_seconds())))


def _why_not(state: AgentState, obs: Observation) -> str:
    if state.phase not in (Phase.RUNNING, Phase.REFORMING):
        return "its workers are in no round"
    if obs.workers is not WorkerState.RUNNING:
        return "its workers are not running"
    return "its workers do not recover in place (restart mode)"


def can_leave_at_boundary(state: AgentState, obs: Observation) -> bool:
    """The workers run in a round and recover in place: they can stop at a boundary."""
    return (state.phase in (Phase.RUNNING, Phase.REFORMING)
            and obs.workers is WorkerState.RUNNING and acks_in_process(obs.acks))


def left_step(left: tuple[int | None, ...]) -> int | None:
    """The step after which every local worker left, once all have; else None."""
    if not left or any(step is None for step in left):
        return None
    return max(step for step in left if step is not None)


def on_leave_written(state: AgentState, obs: LeaveWritten, settings: Settings) -> Decision:
    """The round without us is written, or another round came first: then once more, on
    the round that stands, if it still lists us and there is time."""
    leaving = state.leaving
    assert leaving is not None, "a leave is written only while leaving"
    notice, me = leaving.notice, settings.node_id
    current = obs.current
    if (obs.written is None and current is not None and me in current.members
            and obs.now < leaving.deadline):
        return Decision(state, (_leave(current, obs.step, settings, obs.now_ms, notice),))
    why = "" if obs.written is not None else "the round without it was not written"
    return Decision(state, (Exit(_left(notice, step=obs.step, why=why)),))


def hurried(decision: Decision, settings: Settings) -> Decision:
    """While leaving, sleep at most ``leave_poll``: the others wait from the boundary on."""
    if decision.state.leaving is None:
        return decision
    poll = settings.leave_poll.total_seconds()
    actions: list[Action] = [dataclasses.replace(a, seconds=min(a.seconds, poll))
                             if isinstance(a, Sleep) else a for a in decision.actions]
    return dataclasses.replace(decision, actions=tuple(actions))


def _leave(round_: Round, step: int, settings: Settings, now_ms: int,
           notice: LeaveNotice) -> Action:
    me = settings.node_id
    if round_.members == (me,):  # the last member: nobody to hand a round to
        return Exit(_left(notice, step=step))
    reason = f"left {me} after step {step} ({notice.source})"
    return LeaveAtBoundary(without(round_, me, reason, now_ms, settings.limits), step)


def _at_once(state: AgentState, notice: LeaveNotice, why: str) -> Decision:
    return Decision(state, (Exit(_left(notice, why=why)),))


def _left(notice: LeaveNotice, *, step: int | None = None, why: str = "") -> Left:
    return Left(notice.signum, step=step, source=notice.source, why=why)
