"""Leaving on notice, as pure decisions: at the workers' next step boundary, else at once."""

from __future__ import annotations

import dataclasses
import signal
from datetime import timedelta

import pytest

from agents import policy
from agents.policy import (
    AgentState,
    AnnounceLeave,
    Exit,
    LeaveAtBoundary,
    LeaveNotice,
    LeaveWritten,
    Left,
    Observation,
    Phase,
    Settings,
    Sleep,
)
from agents.worker_state import WorkerExit, WorkerState
from elastic_rt.rendezvous.rounds import Limits, NodeInfo, Round, Snapshot

SETTINGS = Settings(node_id="c", limits=Limits(min_nodes=2, max_nodes=3),
                    monitor_interval=timedelta(seconds=0.1), leave_timeout=timedelta(seconds=20))
NOW, NOW_MS = 1000.0, 5_000_000
R1 = Round(number=1, members=("a", "b", "c"), nprocs=(1, 1, 1), hosts=("h", "h", "h"), token=50)
R2 = dataclasses.replace(R1, number=2, token=60)
SIGTERM = LeaveNotice(source="SIGTERM", signum=signal.SIGTERM)
POLLED = LeaveNotice(source="http://127.0.0.1:8/preempted", detail='{"preempted": true}')
RUNNING = AgentState(phase=Phase.RUNNING, round=R1, ever_ran=True, in_process_published=True)
LEAVING = dataclasses.replace(RUNNING, leaving=policy.Leaving(SIGTERM, deadline=NOW + 20))


def observe(*, notice: LeaveNotice | None = SIGTERM, workers: WorkerState = WorkerState.RUNNING,
            acks: tuple[int | None, ...] = (1,), left: tuple[int | None, ...] = (None,),
            now: float = NOW, **kwargs: object) -> Observation:
    nodes = {n: NodeInfo(node_id=n, host="h", nproc=1) for n in R1.members}
    return Observation(now=now, now_ms=NOW_MS + int((now - NOW) * 1000),
                       snapshot=Snapshot(round=R1, nodes=nodes), workers=workers, acks=acks,
                       notice=notice, left=left, **kwargs)  # type: ignore[arg-type]


def kinds(decision: policy.Decision) -> list[str]:
    return [type(a).__name__ for a in decision.actions]


CASES = [
    # (name, state, observation, expected action kinds)
    ("a notice to in-process workers: tell them and look again soon", RUNNING, observe(),
     ["AnnounceLeave", "Sleep"]),
    ("a notice to restart-mode workers: leave at once", RUNNING, observe(acks=(None,)),
     ["AnnounceLeave", "Exit"]),
    ("a notice before any round: leave at once", AgentState(),
     observe(workers=WorkerState.IDLE, acks=()), ["AnnounceLeave", "Exit"]),
    ("a notice in standby: leave at once",
     dataclasses.replace(RUNNING, phase=Phase.STANDBY), observe(acks=(-1,)),
     ["AnnounceLeave", "Exit"]),
    ("pending: the workers have not reached the boundary", LEAVING, observe(), ["Sleep"]),
    ("the workers left after step 41: write the round without us", LEAVING,
     observe(left=(41,)), ["LeaveAtBoundary"]),
    ("one of two workers left: wait for the other", LEAVING,
     observe(acks=(1, 1), left=(41, None)), ["Sleep"]),
    ("past the deadline: leave at once", LEAVING, observe(now=NOW + 21), ["Exit"]),
    ("a worker failed: leave at once", LEAVING,
     observe(workers=WorkerState.FAILED, exits=(WorkerExit(0, 7, 1),)), ["Exit"]),
    ("the job finished: succeed, not leave", LEAVING,
     observe(workers=WorkerState.SUCCEEDED), ["Succeed"]),
    ("a second signal: leave at once", LEAVING, observe(leave_signal=signal.SIGTERM), ["Exit"]),
    ("a new round while pending: follow it, the workers leave after it", LEAVING,
     dataclasses.replace(observe(), snapshot=Snapshot(
         round=R2, nodes={n: NodeInfo(node_id=n, host="h", nproc=1) for n in R2.members})),
     ["FollowRound"]),
]


@pytest.mark.parametrize(("state", "obs", "actions"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide_with_a_notice(state: AgentState, obs: Observation, actions: list[str]) -> None:
    assert kinds(policy.decide(state, obs, SETTINGS)) == actions


def test_the_first_notice_sets_the_deadline_and_tells_the_workers() -> None:
    decision = policy.decide(RUNNING, observe(), SETTINGS)
    assert decision.state.leaving == policy.Leaving(SIGTERM, deadline=NOW + 20)
    assert decision.actions == (AnnounceLeave(SIGTERM, NOW_MS + 20_000, at_boundary=True),
                                Sleep(SETTINGS.leave_poll.total_seconds()))


def test_a_notice_with_a_sooner_time_of_its_own_brings_the_deadline_forward() -> None:
    soon = dataclasses.replace(POLLED, deadline_ms=NOW_MS + 8_000)
    decision = policy.decide(RUNNING, observe(notice=soon), SETTINGS)
    assert decision.state.leaving is not None and decision.state.leaving.deadline == NOW + 8
    late = dataclasses.replace(POLLED, deadline_ms=NOW_MS + 120_000)  # AWS: two minutes
    assert policy.decide(RUNNING, observe(notice=late), SETTINGS).state.leaving == \
        policy.Leaving(late, deadline=NOW + 20)


def test_while_leaving_the_agent_looks_at_its_workers_every_leave_poll() -> None:
    (sleep,) = policy.decide(LEAVING, observe(), SETTINGS).actions
    assert sleep == Sleep(SETTINGS.leave_poll.total_seconds())
    assert SETTINGS.leave_poll < SETTINGS.monitor_interval


def test_the_round_without_us_keeps_the_others_in_order() -> None:
    (leave,) = policy.decide(LEAVING, observe(left=(41,)), SETTINGS).actions
    assert isinstance(leave, LeaveAtBoundary) and leave.step == 41
    assert leave.proposal.expected_token == R1.token
    assert (leave.proposal.round.number, leave.proposal.round.members) == (2, ("a", "b"))
    assert leave.proposal.round.reason == "left c after step 41 (SIGTERM)"


def test_the_last_member_leaves_without_a_round() -> None:
    alone = dataclasses.replace(LEAVING, round=dataclasses.replace(R1, members=("c",),
                                                                   nprocs=(1,), hosts=("h",)))
    assert policy.decide(alone, observe(left=(41,)), SETTINGS).actions == (
        Exit(Left(signal.SIGTERM, step=41, source="SIGTERM")),)


def test_written_the_node_exits_with_the_step_it_left_after() -> None:
    written = LeaveWritten(R2, R2, step=41, now=NOW)
    assert policy.decide(LEAVING, written, SETTINGS).actions == (
        Exit(Left(signal.SIGTERM, step=41, source="SIGTERM")),)


def test_a_round_written_first_is_left_again_while_it_lists_us() -> None:
    newer = dataclasses.replace(R1, number=2, token=70, reason="admitting d",
                                members=("a", "b", "c", "d"), nprocs=(1, 1, 1, 1),
                                hosts=("h",) * 4)
    (again,) = policy.decide(LEAVING, LeaveWritten(None, newer, step=41, now=NOW),
                             SETTINGS).actions
    assert isinstance(again, LeaveAtBoundary)
    assert again.proposal.expected_token == 70 and again.proposal.round.members == ("a", "b", "d")
    without_us = dataclasses.replace(newer, members=("a", "b"), nprocs=(1, 1), hosts=("h",) * 2)
    (exit_,) = policy.decide(LEAVING, LeaveWritten(None, without_us, step=41, now=NOW),
                             SETTINGS).actions
    assert isinstance(exit_, Exit) and isinstance(exit_.outcome, Left)
    late = LeaveWritten(None, newer, step=41, now=NOW + 30)
    assert kinds(policy.decide(LEAVING, late, SETTINGS)) == ["Exit"]


@pytest.mark.parametrize(("outcome", "code"), [
    (Left(signal.SIGTERM, step=41, source="SIGTERM"), 143),
    (Left(None, step=41, source="http://127.0.0.1:8/preempted"), 0),
    (Left(None, source="file:/run/preempted", why="no step boundary came in time"), 0),
])
def test_a_notice_leave_exits_0_and_a_signal_one_as_a_shell_would(
        outcome: Left, code: int) -> None:
    assert policy.exit_code(outcome) == code


def test_at_once_says_why() -> None:
    (_, exit_) = policy.decide(RUNNING, observe(acks=(None,)), SETTINGS).actions
    assert exit_ == Exit(Left(signal.SIGTERM, source="SIGTERM",
                              why="its workers do not recover in place (restart mode)"))
    (late,) = policy.decide(LEAVING, observe(now=NOW + 21), SETTINGS).actions
    assert late == Exit(Left(signal.SIGTERM, source="SIGTERM",
                             why="no step boundary came before the leave timeout"))
