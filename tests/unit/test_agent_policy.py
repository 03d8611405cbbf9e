"""The agent's pure decisions: what a node does for each thing it can observe."""

from __future__ import annotations

import dataclasses
import signal
from datetime import timedelta

import pytest

from agents import policy
from agents.policy import (
    AgentState,
    AlarmVerdict,
    Exit,
    Failed,
    FailureFacts,
    FailureStep,
    Finished,
    Left,
    Observation,
    Phase,
    Settings,
)
from agents.worker_state import WorkerExit, WorkerState
from elastic_rt.rendezvous.rounds import Limits, NodeInfo, Round, Snapshot, Wait
from elastic_rt.root_cause import RootCause

SETTINGS = Settings(node_id="a", limits=Limits(min_nodes=2, max_nodes=3, last_call=5.0),
                    monitor_interval=timedelta(seconds=0.1), join_timeout=timedelta(seconds=60),
                    reform_timeout=timedelta(seconds=30), max_restarts=2)
NOW = 1000.0


def nodes(*names: str) -> dict[str, NodeInfo]:
    return {n: NodeInfo(node_id=n, host=f"h-{n}", nproc=1, joined_revision=10 + i)
            for i, n in enumerate(names)}


def round_of(*members: str, number: int = 1, token: int = 50) -> Round:
    return Round(number=number, members=members, nprocs=(1,) * len(members),
                 hosts=tuple(f"h-{m}" for m in members), token=token)


R1 = round_of("a", "b", number=1)
R2 = round_of("a", "b", "c", number=2, token=60)
IN_R1 = Snapshot(round=R1, nodes=nodes("a", "b"))
PAUSED_R2 = round_of("a", number=2, token=70)
"""Fewer than min (2) members: the leader's way of telling every node to stop."""
RUNNING_R1 = AgentState(phase=Phase.RUNNING, round=R1, ever_ran=True)
FAIL = WorkerExit(local_rank=0, pid=7, exitcode=3)


def observe(snapshot: Snapshot | None = IN_R1, workers: WorkerState = WorkerState.RUNNING,
            **kwargs: object) -> Observation:
    return Observation(now=NOW, now_ms=5, snapshot=snapshot, workers=workers,
                       **kwargs)  # type: ignore[arg-type]


def kinds(decision: policy.Decision) -> list[str]:
    return [type(a).__name__ for a in decision.actions]


def after(state: AgentState, *observed: policy.Observed) -> AgentState:
    """The state once each of ``observed`` was decided on, in order."""
    for obs in observed:
        state = policy.decide(state, obs, SETTINGS).state
    return state


def following(state: AgentState, round_: Round, now: float = NOW) -> AgentState:
    return after(state, policy.RoundFollowed(round_, now=now))


# outcomes ------------------------------------------------------------------------------
@pytest.mark.parametrize(("outcome", "code"), [
    (Finished("finished"), 0),
    (Failed("worker 0 on a exited with 1"), 1),
    (Left(signal.SIGTERM), 143),
    (Left(signal.SIGINT), 130),
])
def test_exit_codes_come_from_the_outcome_type(outcome: policy.Outcome, code: int) -> None:
    assert policy.exit_code(outcome) == code


@pytest.mark.parametrize("outcome", [
    Finished("finished"), Finished("the job is finishing"),
    Failed("worker 0 on a exited with 1; the restart budget of 3 is spent"),
])
def test_a_closed_record_reads_back_as_the_outcome_that_wrote_it(
        outcome: Finished | Failed) -> None:
    record = policy.closed_record(outcome)
    assert policy.closed_outcome(record) == outcome
    assert record.startswith("failed: ") == isinstance(outcome, Failed)  # status shows it


# one turn of the loop --------------------------------------------------------------------
CASES = [
    # (name, state, observation, expected action kinds, expected phase after)
    ("leave signal first", RUNNING_R1, observe(leave_signal=signal.SIGTERM), ["Exit"],
     Phase.RUNNING),
    ("etcd down: workers keep running", RUNNING_R1, observe(store_error=True), ["Sleep"],
     Phase.RUNNING),
    ("too few nodes: wait", AgentState(), observe(Snapshot(round=None, nodes=nodes("a")),
                                                  WorkerState.IDLE), ["Sleep"], Phase.IDLE),
    ("all nodes there: propose", AgentState(),
     observe(Snapshot(round=None, nodes=nodes("a", "b", "c")), WorkerState.IDLE),
     ["ProposeRound"], Phase.IDLE),
    ("a round with us: start", AgentState(), observe(workers=WorkerState.IDLE), ["StartWorkers"],
     Phase.IDLE),
    ("same round, healthy", RUNNING_R1, observe(), ["Sleep"], Phase.RUNNING),
    ("same round, not re-read", RUNNING_R1, observe(None), ["Sleep"], Phase.RUNNING),
    ("same round, succeeded", RUNNING_R1, observe(workers=WorkerState.SUCCEEDED), ["Succeed"],
     Phase.RUNNING),
    ("same round, failed", RUNNING_R1, observe(workers=WorkerState.FAILED, exits=(FAIL,)),
     ["HandleFailure"], Phase.RUNNING),
    ("new round, restart-mode workers: restart them", RUNNING_R1,
     observe(Snapshot(round=R2, nodes=nodes("a", "b", "c"))), ["StopWorkers", "StartWorkers"],
     Phase.IDLE),
    ("new round, in-process workers: follow", RUNNING_R1,
     observe(Snapshot(round=R2, nodes=nodes("a", "b", "c")), acks=(1,)), ["FollowRound"],
     Phase.RUNNING),
    ("new round, a dead in-process worker: a failure", RUNNING_R1,
     observe(Snapshot(round=R2, nodes=nodes("a", "b", "c")), WorkerState.FAILED, acks=(1,),
             exits=(FAIL,)), ["HandleFailure"], Phase.RUNNING),
    ("peer lost below min: the leader pauses the round", RUNNING_R1,
     observe(Snapshot(round=R1, nodes=nodes("a"))), ["ProposeRound"], Phase.RUNNING),
    ("a paused round: stop and wait", RUNNING_R1,
     observe(Snapshot(round=PAUSED_R2, nodes=nodes("a"))), ["StopWorkers", "Sleep"], Phase.IDLE),
    ("a paused round reaches a follower: stop and wait", RUNNING_R1,
     observe(Snapshot(round=PAUSED_R2, nodes={}, nodes_known=False)), ["StopWorkers", "Sleep"],
     Phase.IDLE),
    ("standby workers are not stopped while waiting", dataclasses.replace(
        RUNNING_R1, phase=Phase.STANDBY, round=dataclasses.replace(R1, number=-1)),
     observe(Snapshot(round=PAUSED_R2, nodes=nodes("a"))), ["Sleep"], Phase.STANDBY),
    ("standby admitted: follow", dataclasses.replace(
        RUNNING_R1, phase=Phase.STANDBY, round=dataclasses.replace(R1, number=-1)),
     observe(acks=(-1,)), ["FollowRound"], Phase.STANDBY),
    ("closed as failed", RUNNING_R1,
     observe(dataclasses.replace(IN_R1, closed="failed: boom")), ["Exit"], Phase.RUNNING),
]


@pytest.mark.parametrize(("state", "obs", "actions", "phase"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_decide(state: AgentState, obs: Observation, actions: list[str], phase: Phase) -> None:
    decision = policy.decide(state, obs, SETTINGS)
    assert kinds(decision) == actions
    assert decision.state.phase is phase


def test_restart_mode_workers_whose_peer_is_gone_get_no_grace_period() -> None:
    """A framework's SIGTERM handler on a broken group can only wait out the grace."""
    running_r2 = dataclasses.replace(RUNNING_R1, round=R2)  # a, b, c
    shrunk = round_of("a", "c", number=3, token=80)
    stop, _ = policy.decide(running_r2, observe(Snapshot(round=shrunk, nodes=nodes("a", "c"))),
                            SETTINGS).actions
    assert stop == policy.StopWorkers("round 3 formed without ['b']", grace=False)
    grown, _ = policy.decide(RUNNING_R1, observe(Snapshot(round=R2, nodes=nodes("a", "b", "c"))),
                             SETTINGS).actions
    assert grown == policy.StopWorkers("round 2 formed", grace=True)  # every peer is alive


def test_leaving_and_closing_end_with_typed_outcomes() -> None:
    leave = policy.decide(RUNNING_R1, observe(leave_signal=signal.SIGINT), SETTINGS)
    assert leave.actions == (Exit(Left(signal.SIGINT)),)
    closed = policy.decide(RUNNING_R1, observe(dataclasses.replace(IN_R1, closed="finished")),
                           SETTINGS)
    assert closed.actions == (Exit(Finished("finished")),)


def test_join_times_out_only_before_the_first_round() -> None:
    lonely = Snapshot(round=None, nodes=nodes("a"))
    late = observe(lonely, WorkerState.IDLE, waited=61.0)
    assert kinds(policy.decide(AgentState(), late, SETTINGS)) == ["JoinTimedOut", "Sleep"]
    ran = AgentState(ever_ran=True)
    assert kinds(policy.decide(ran, late, SETTINGS)) == ["Sleep"]
    assert kinds(policy.decide(AgentState(), observe(lonely, WorkerState.IDLE, waited=59.0),
                               SETTINGS)) == ["Sleep"]


def test_last_call_start_is_kept_in_the_state() -> None:
    two = Snapshot(round=None, nodes=nodes("a", "b"))
    first = policy.decide(AgentState(), observe(two, WorkerState.IDLE), SETTINGS)
    assert first.state.quorum_since == NOW and isinstance(first.rendezvous, Wait)
    later = dataclasses.replace(observe(two, WorkerState.IDLE), now=NOW + 5.0)
    assert kinds(policy.decide(first.state, later, SETTINGS)) == ["ProposeRound"]


def test_starting_and_following_move_the_state() -> None:
    start = policy.decide(AgentState(), observe(workers=WorkerState.IDLE), SETTINGS)
    assert start.actions == (policy.StartWorkers(R1, first=True),)
    first = after(start.state, policy.WorkersStarted(R1))
    assert (first.phase, first.round) == (Phase.RUNNING, R1)
    restart = policy.decide(first, observe(Snapshot(round=R2, nodes=nodes("a", "b", "c"))),
                            SETTINGS)
    assert restart.actions[-1] == policy.StartWorkers(R2, first=False)
    assert after(restart.state, policy.WorkersStarted(R2)).round == R2
    follow = following(first, R2)
    assert (follow.phase, follow.round, follow.ack_deadline) == (Phase.REFORMING, R2, NOW + 30)


@pytest.mark.parametrize(("acks", "now", "actions", "phase"), [
    ((2,), NOW, ["PublishInProcess", "Sleep"], Phase.RUNNING),  # joined: settled
    ((1,), NOW, ["PublishInProcess", "Sleep"], Phase.REFORMING),  # not yet
    ((1,), NOW + 31, ["StopWorkers", "Sleep"], Phase.IDLE),  # too late: restart mode
])
def test_reforming_workers_settle_or_are_restarted(acks: tuple[int, ...], now: float,
                                                   actions: list[str], phase: Phase) -> None:
    state = following(RUNNING_R1, R2)
    obs = dataclasses.replace(observe(Snapshot(round=R2, nodes=nodes("a", "b", "c")), acks=acks),
                              now=now)
    decision = policy.decide(state, obs, SETTINGS)
    assert kinds(decision) == actions
    assert decision.state.phase is phase


def test_in_process_recovery_is_published_once() -> None:
    first = policy.decide(RUNNING_R1, observe(acks=(1,)), SETTINGS)
    assert kinds(first) == ["PublishInProcess", "Sleep"]
    assert kinds(policy.decide(first.state, observe(acks=(1,)), SETTINGS)) == ["Sleep"]


def test_a_fenced_node_asks_for_a_restart_round_when_its_round_still_stands() -> None:
    fenced = after(RUNNING_R1, policy.Fenced(), policy.Registered())  # restart mode
    assert (fenced.phase, fenced.round, fenced.running) == (Phase.FENCED, R1, None)
    # still the round to rejoin
    assert after(fenced, policy.Fenced()) == after(RUNNING_R1, policy.Fenced())
    decision = policy.decide(fenced, observe(workers=WorkerState.IDLE), SETTINGS)
    (action,) = decision.actions
    assert isinstance(action, policy.ProposeRound)
    assert action.proposal.round.members == R1.members and action.proposal.round.number == 2
    assert action.proposal.round.reason == "a rejoined"
    assert decision.state.phase is Phase.IDLE
    moved_on = policy.decide(fenced, observe(Snapshot(round=R2, nodes=nodes("a", "b", "c")),
                                             WorkerState.IDLE), SETTINGS)
    assert moved_on.actions == (policy.StartWorkers(R2, first=False),)


FENCED_R1 = after(RUNNING_R1, policy.Fenced())


def rejoin_in_standby(round_: Round) -> tuple[policy.Action, ...]:
    return (policy.RevokeLostLease(),
            policy.StartInStandby(round_, restart_count=0, first=False, register=True))


@pytest.mark.parametrize(("snapshot", "actions"), [
    # in place: the survivors re-formed without us, or not yet (we are still listed)
    (Snapshot(round=R2, nodes=nodes("b", "c"), in_process=True), rejoin_in_standby(R2)),
    (Snapshot(round=R1, nodes=nodes("a", "b"), in_process=True), rejoin_in_standby(R1)),
    # restart mode, or a job ending: register, and the next round restarts us (or ends)
    (Snapshot(round=R2, nodes=nodes("b", "c")), (policy.Register(),)),
    (Snapshot(round=R1, nodes=nodes("a", "b"), in_process=True, completing=True),
     (policy.Register(),)),
])
def test_a_fenced_node_registers_again_only_through_the_standby_start_when_in_place(
        snapshot: Snapshot, actions: tuple[policy.Action, ...]) -> None:
    assert not FENCED_R1.registered
    decision = policy.decide(FENCED_R1, observe(snapshot, WorkerState.IDLE), SETTINGS)
    assert decision.actions == actions
    assert decision.state == FENCED_R1  # registering comes back as an observation


def test_a_fenced_node_whose_run_closed_leaves_without_registering() -> None:
    closed = Snapshot(round=R1, nodes=nodes("b"), in_process=True, closed="finished")
    decision = policy.decide(FENCED_R1, observe(closed, WorkerState.IDLE), SETTINGS)
    assert kinds(decision) == ["Exit"]


def test_a_new_alarm_in_our_round_is_answered_once() -> None:
    alarmed = dataclasses.replace(IN_R1, alarm=(1, 900))
    first = policy.decide(RUNNING_R1, observe(alarmed), SETTINGS)
    assert first.actions == (policy.ProbePeers(R1),) and first.state.alarm_seen == 900
    assert kinds(policy.decide(first.state, observe(alarmed), SETTINGS)) == ["Sleep"]
    stale = dataclasses.replace(IN_R1, alarm=(0, 901))  # an older round's alarm
    assert kinds(policy.decide(first.state, observe(stale), SETTINGS)) == ["Sleep"]


@pytest.mark.parametrize(("dead", "unsure", "workers", "verdict", "proposes"), [
    (["b"], [], WorkerState.RUNNING, AlarmVerdict.HANDLED, False),
    ([], ["b"], WorkerState.RUNNING, AlarmVerdict.CARRY_ON, False),  # hung: its lease decides
    ([], [], WorkerState.FAILED, AlarmVerdict.CARRY_ON, False),  # our own worker died
    ([], [], WorkerState.RUNNING, AlarmVerdict.HANDLED, True),  # all answer: re-form
])
def test_alarm_verdict(dead: list[str], unsure: list[str], workers: WorkerState,
                       verdict: AlarmVerdict, proposes: bool) -> None:
    got, proposal = policy.alarm_verdict(R1, dead=dead, unsure=unsure, workers=workers, now_ms=5)
    assert got is verdict and (proposal is not None) == proposes


# the end of a job -------------------------------------------------------------------------
def test_a_node_admitted_as_the_job_finished_closes_it_and_leaves() -> None:
    alone = Snapshot(round=R1, nodes=nodes("a"), completing=True)
    decision = policy.decide(AgentState(), observe(alone, WorkerState.IDLE), SETTINGS)
    assert kinds(decision) == ["CloseRun", "Exit"]
    assert all(isinstance(getattr(a, "outcome"), Finished) for a in decision.actions)


@pytest.mark.parametrize(("state", "workers", "acks", "expected"), [
    (AgentState(), WorkerState.IDLE, (), True),  # no workers at all
    (AgentState(), WorkerState.RUNNING, (0,), True),  # in-process, never joined round 1
    (AgentState(), WorkerState.RUNNING, (1,), False),  # joined: may still write outputs
    (AgentState(), WorkerState.RUNNING, (), False),  # restart-mode workers
    (RUNNING_R1, WorkerState.SUCCEEDED, (), False),
])
def test_finished_without_us(state: AgentState, workers: WorkerState, acks: tuple[int, ...],
                             expected: bool) -> None:
    alone = Snapshot(round=R1, nodes=nodes("a"), completing=True)
    obs = observe(alone, workers, acks=acks)
    assert policy.finished_without_us(state, alone, obs, "a") is expected


# joining -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("snapshot", "standby"), [
    (dataclasses.replace(IN_R1, in_process=True), True),  # listed: we restarted
    (Snapshot(round=R1, nodes=nodes("b"), in_process=True), True),  # listed, lease gone
    (Snapshot(round=round_of("b", "c"), nodes=nodes("b", "c"), in_process=True), True),
    (Snapshot(round=round_of("b", "c"), nodes=nodes("b", "c")), False),  # restart mode
    (Snapshot(round=round_of("b", "c"), nodes={}, in_process=True, completing=True), False),
])
def test_joins_in_standby(snapshot: Snapshot, standby: bool) -> None:
    assert policy.joins_in_standby(snapshot) is standby


def test_a_finished_run_with_nobody_left_is_stale() -> None:
    assert policy.is_stale_run(Snapshot(round=R1, nodes={}, closed="finished"))
    assert not policy.is_stale_run(Snapshot(round=R1, nodes=nodes("b"), closed="finished"))
    assert not policy.is_stale_run(Snapshot(round=R1, nodes={}))


def test_a_follower_without_registrations_never_reads_them_as_everyone_gone() -> None:
    # A follower of the elected leader sees no registrations (nodes_known=False).
    follower = Snapshot(round=R1, nodes={}, completing=True, closed="finished", nodes_known=False)
    assert not policy.is_stale_run(follower)
    obs = observe(follower, WorkerState.IDLE)
    assert not policy.finished_without_us(AgentState(), follower, obs, "a")


@pytest.mark.parametrize(("state", "dirty", "since", "read"), [
    (RUNNING_R1, False, 0.5, False),
    (RUNNING_R1, False, 1.0, True),
    (RUNNING_R1, True, 0.0, True),
    (AgentState(), False, 0.0, True),
    (following(RUNNING_R1, R2), False, 0.0, True),
])
def test_should_read(state: AgentState, dirty: bool, since: float, read: bool) -> None:
    assert policy.should_read(state, dirty=dirty, since_read=since, settings=SETTINGS) is read


# worker failures -------------------------------------------------------------------------------
def facts(snapshot: Snapshot, *, in_process: bool = False) -> FailureFacts:
    return FailureFacts(R1, snapshot, in_process, FAIL, "a", now_ms=5)


@pytest.mark.parametrize(("snapshot", "in_process", "step"), [
    (dataclasses.replace(IN_R1, completing=True), False,
     Failed("a worker exited with 3 while the job was finishing")),
    (Snapshot(round=R2, nodes=nodes("a", "b", "c")), False, FailureStep.IGNORE),
    (Snapshot(round=R2, nodes=nodes("a", "b", "c")), True, FailureStep.CLAIM),
    (IN_R1, False, FailureStep.PROBE),
    (IN_R1, True, FailureStep.PROBE),
    (dataclasses.replace(IN_R1, closed="failed: rank 0 failed at step 5: KeyError: 'x'"), True,
     Failed("rank 0 failed at step 5: KeyError: 'x'")),
])
def test_first_step_after_a_worker_failure(snapshot: Snapshot, in_process: bool,
                                           step: FailureStep | Failed) -> None:
    assert policy.on_worker_failure(facts(snapshot, in_process=in_process)) == step


def test_restart_budget_and_the_ways_to_restart() -> None:
    spent = policy.on_restart_counted(facts(IN_R1), 3, SETTINGS)
    assert spent == Failed("worker 0 on a exited with 3; the restart budget of 2 is spent")

    again = policy.on_restart_counted(facts(IN_R1), 2, SETTINGS)
    assert isinstance(again, policy.ProposeRound)
    assert again.proposal.round.reason == "worker 0 on a exited with 3 (restart 2/2)"
    assert again.proposal.round.members == R1.members and again.proposal.expected_token == 50

    three = Snapshot(round=round_of("a", "b", "c"), nodes=nodes("a", "b", "c"))
    standby = policy.on_restart_counted(facts(three, in_process=True), 1, SETTINGS)
    assert isinstance(standby, policy.RestartInStandby) and standby.round == three.round
    # At min nodes, stepping out would stop the job: the node stays without ranks instead.
    replace = policy.on_restart_counted(facts(IN_R1, in_process=True), 1, SETTINGS)
    assert isinstance(replace, policy.ReplaceWorkers)
    without = replace.proposal.proposal
    assert (without.round.members, without.round.nprocs) == (R1.members, (0, 1))
    assert (without.round.number, without.expected_token) == (2, R1.token)
    # A peer's alarm already restarted the round with our ranks: replaced again, from there.
    restarted = Snapshot(round=dataclasses.replace(R1, number=2, token=55), nodes=nodes("a", "b"))
    again_without = policy.on_restart_counted(facts(restarted, in_process=True), 1, SETTINGS)
    assert isinstance(again_without, policy.ReplaceWorkers)
    assert again_without.proposal.proposal.expected_token == 55
    moved_on = Snapshot(round=R2, nodes=nodes("a", "b"))
    assert policy.on_restart_counted(facts(moved_on), 1, SETTINGS) is None


WITHOUT_A = dataclasses.replace(R1, number=2, nprocs=(0, 1), token=60)
"""a's workers are being replaced: it is a member with no ranks."""
STANDBY = AgentState(phase=Phase.STANDBY, round=dataclasses.replace(WITHOUT_A, number=-1),
                     ever_ran=True)


@pytest.mark.parametrize(("state", "obs", "grows_back"), [
    (STANDBY, observe(Snapshot(round=WITHOUT_A, nodes=nodes("a", "b")), acks=(-1,)), True),
    # replacements still importing (no announcement yet): not yet
    (STANDBY, observe(Snapshot(round=WITHOUT_A, nodes=nodes("a", "b")), acks=(None,)), False),
    # they did not start in time and were stopped: the round restarts ours
    (AgentState(ever_ran=True), observe(Snapshot(round=WITHOUT_A, nodes=nodes("a", "b")),
                                        WorkerState.IDLE), True),
    # the job is finishing: no new rounds
    (STANDBY, observe(Snapshot(round=WITHOUT_A, nodes=nodes("a", "b"), completing=True),
                      acks=(-1,)), False),
    # our ranks are in the round already
    (STANDBY, observe(acks=(-1,)), False),
    # round 2 has not trained a step yet: its ranks may still be joining
    (STANDBY, observe(Snapshot(round=WITHOUT_A, nodes=nodes("a", "b"), in_process=True,
                               trained_round=1), acks=(-1,)), False),
    (STANDBY, observe(Snapshot(round=WITHOUT_A, nodes=nodes("a", "b"), in_process=True,
                               trained_round=2), acks=(-1,)), True),
    # a round without ranks cannot train: grow back at once
    (STANDBY, observe(Snapshot(round=dataclasses.replace(WITHOUT_A, nprocs=(0, 0)),
                               nodes=nodes("a", "b"), in_process=True, trained_round=1),
                      acks=(-1,)), True),
])
def test_a_node_whose_workers_were_replaced_asks_for_its_ranks_back(
        state: AgentState, obs: Observation, grows_back: bool) -> None:
    decision = policy.decide(state, obs, SETTINGS)
    proposals = [a for a in decision.actions if isinstance(a, policy.ProposeRound)]
    assert bool(proposals) == grows_back, decision.actions
    if grows_back:
        (back,) = proposals
        assert (back.proposal.round.nprocs[0], back.proposal.round.number) == (1, 3)
        assert back.proposal.expected_token == WITHOUT_A.token


# root causes ---------------------------------------------------------------------------
def cause(round_: int, error: str = "ValueError: bad", step: int | None = None,
          line: int = 7) -> RootCause:
    tb = f'Traceback (most recent call last):\n  File "train.py", line {line}, in main\n' if error \
        else ""
    return RootCause(round=round_, rank=1, node="b", host="h-b", time_ms=0, exitcode=1,
                     error=error, traceback=tb, step=step)


@pytest.mark.parametrize(("new", "old", "replaces"), [
    (cause(1), None, True),
    (cause(2), cause(1), True),
    (cause(1), cause(2), False),  # a late report of an older round
    (cause(1), cause(1, error=""), True),  # the exception beats an exit code, same round
    (cause(1, error=""), cause(1), False),
    (cause(1, error="KeyError: x"), cause(1), False),  # first exception of a round stays
])
def test_which_root_cause_the_run_keeps(new: RootCause, old: RootCause | None,
                                        replaces: bool) -> None:
    assert policy.supersedes(new, old) is replaces


@pytest.mark.parametrize(("new", "previous", "repeated"), [
    (cause(2), cause(1), True),  # a script error before any completed step, twice
    (cause(2, step=40), cause(1, step=40), True),  # the same exception at the same step
    (cause(2, step=41), cause(1, step=40), False),
    (cause(2, error="KeyError: x"), cause(1), False),
    (cause(2, line=9), cause(1), False),  # same message, raised elsewhere
    (cause(2, error=""), cause(1, error=""), False),  # exit codes only: maybe an OOM kill
    (cause(2), None, False),
    (cause(1), cause(1), False),  # the same round's report, not an earlier attempt
])
def test_the_same_failure_after_a_restart_ends_the_job(new: RootCause, previous: RootCause | None,
                                                       repeated: bool) -> None:
    verdict = policy.repeated_failure(new, previous)
    assert (verdict is not None) is repeated
    if verdict is not None:
        assert "rank 1 on h-b (b)" in verdict.reason and "ValueError: bad" in verdict.reason


@pytest.mark.parametrize(("error", "claimed", "reported"), [
    ("ValueError: bad", False, True), ("", True, True), ("", False, False),
])
def test_who_reports_a_root_cause(error: str, claimed: bool, reported: bool) -> None:
    assert policy.should_report(cause(1, error=error), claimed=claimed) is reported


def test_a_spent_budget_names_the_exception() -> None:
    facts = FailureFacts(R1, IN_R1, False, FAIL, "a", cause=cause(1))
    verdict = policy.on_restart_counted(facts, SETTINGS.max_restarts + 1, SETTINGS)
    assert isinstance(verdict, Failed)
    assert "ValueError: bad" in verdict.reason and "budget of 2 is spent" in verdict.reason


# what the agent used to apply itself, now results fed back to decide ----------------------
STANDBY_R1 = dataclasses.replace(R1, number=-1)
FOLLOWING_R2 = dataclasses.replace(RUNNING_R1, phase=Phase.REFORMING, round=R2,
                                   ack_deadline=NOW + 30)
TRANSITIONS = [
    # (name, state, observation, actions, state after)
    ("workers started: running, first start", AgentState(), policy.WorkersStarted(R1), (),
     RUNNING_R1),
    ("workers started again", dataclasses.replace(RUNNING_R1, round=None, phase=Phase.IDLE),
     policy.WorkersStarted(R2), (), dataclasses.replace(RUNNING_R1, round=R2)),
    ("store agreed for a re-form: follow until the ack deadline", RUNNING_R1,
     policy.RoundFollowed(R2, now=NOW), (), FOLLOWING_R2),
    ("joining in place: standby workers first", AgentState(), policy.JoiningInPlace(R1),
     (policy.StartInStandby(R1, restart_count=0, first=True, register=True),), AgentState()),
    ("standby workers announced: wait to be admitted", AgentState(),
     policy.StandbyStarted(R1, announced=True, registered=True), (),
     AgentState(phase=Phase.STANDBY, round=STANDBY_R1, ever_ran=True)),
    ("standby workers replacing failed ones: a restart", dataclasses.replace(
        FENCED_R1, phase=Phase.IDLE, round=None),
     policy.StandbyStarted(R1, announced=True, registered=True), (),
     dataclasses.replace(FENCED_R1, phase=Phase.STANDBY, round=STANDBY_R1, registered=True)),
    ("standby workers too slow: stopped, join the normal way", AgentState(),
     policy.StandbyStarted(R1, announced=False, registered=True),
     (policy.StopWorkers("standby workers did not start in time"),), AgentState(ever_ran=True)),
    ("standby under the kept lease: still unregistered if fenced", FENCED_R1,
     policy.StandbyStarted(R1, announced=True, registered=False), (),
     dataclasses.replace(FENCED_R1, phase=Phase.STANDBY, round=STANDBY_R1)),
    ("fenced: stop the workers, remember the round", RUNNING_R1, policy.Fenced(),
     (policy.StopWorkers("the lease was lost"),),
     dataclasses.replace(RUNNING_R1, phase=Phase.FENCED, registered=False)),
    ("fenced with no workers: no round to rejoin", AgentState(), policy.Fenced(),
     (policy.StopWorkers("the lease was lost"),),
     AgentState(phase=Phase.FENCED, registered=False)),
    ("registered again", FENCED_R1, policy.Registered(), (),
     dataclasses.replace(FENCED_R1, registered=True)),
    ("registering failed: retry later", FENCED_R1, policy.RegisterFailed(),
     (policy.Sleep(0.5),), FENCED_R1),
]


@pytest.mark.parametrize(("state", "obs", "actions", "after_"),
                         [case[1:] for case in TRANSITIONS], ids=[case[0] for case in TRANSITIONS])
def test_results_of_actions_move_the_state(state: AgentState, obs: policy.Observed,
                                           actions: tuple[policy.Action, ...],
                                           after_: AgentState) -> None:
    decision = policy.decide(state, obs, SETTINGS)
    assert decision.actions == actions
    assert decision.state == after_


# settling a failure: a phase of decide ----------------------------------------------------
def seen(snapshot: Snapshot, *, in_process: bool = False,
         cause_: RootCause | None = None) -> policy.FailureSeen:
    return policy.FailureSeen(FailureFacts(R1, snapshot, in_process, FAIL, "a", now_ms=5,
                                           cause=cause_))


def settling(facts_: FailureFacts) -> AgentState:
    return AgentState(phase=Phase.SETTLING, ever_ran=True, failure=facts_)


WHAT = "worker 0 on a exited with 3"
CLAIM = policy.ClaimFailure(R1, WHAT, None)
CLOSED_BY_USER = dataclasses.replace(IN_R1, closed="failed: rank 0 failed at step 5: KeyError")
SETTLE_STARTS = [
    # (name, failure seen, actions, phase after)
    ("the user's error closed the run: report, close, exit", seen(CLOSED_BY_USER, cause_=cause(1)),
     ["ReportRootCause", "CloseRun", "Exit"], Phase.IDLE),
    ("the round changed under restart-mode workers: free", seen(
        Snapshot(round=R2, nodes=nodes("a", "b", "c"))), [], Phase.IDLE),
    ("same round: probe the peers first", seen(IN_R1), ["ProbePeers"], Phase.SETTLING),
    ("in-process, round changed: claim at once", seen(
        Snapshot(round=R2, nodes=nodes("a", "b", "c")), in_process=True), ["ClaimFailure"],
     Phase.SETTLING),
]


@pytest.mark.parametrize(("obs", "actions", "phase"), [case[1:] for case in SETTLE_STARTS],
                         ids=[case[0] for case in SETTLE_STARTS])
def test_a_failure_seen_starts_settling_with_the_workers_stopped(
        obs: policy.FailureSeen, actions: list[str], phase: Phase) -> None:
    decision = policy.decide(RUNNING_R1, obs, SETTINGS)
    assert kinds(decision) == actions
    assert decision.state.phase is phase and decision.state.running is None
    assert decision.state.failure == (obs.facts if phase is Phase.SETTLING else None)


SETTLING_R1 = settling(facts(IN_R1))
SETTLING_IN_PLACE = settling(facts(IN_R1, in_process=True))
SETTLING_3 = settling(facts(Snapshot(round=round_of("a", "b", "c"), nodes=nodes("a", "b", "c")),
                            in_process=True))
LOOK = observe(None)
SETTLE_STEPS = [
    # (name, state, observation, actions, settled)
    ("a dead peer explains it: free", SETTLING_R1, policy.PeersProbed(R1, ("b",), (), LOOK), [],
     True),
    ("every peer answers: claim it", SETTLING_R1, policy.PeersProbed(R1, (), (), LOOK),
     ["ClaimFailure"], False),
    ("another node claimed it", SETTLING_R1, policy.FailureClaimed(False, None), [], True),
    ("claimed: count it", SETTLING_R1, policy.FailureClaimed(True, None), ["CountRestart"],
     False),
    ("the same failure again: close the run", SETTLING_R1,
     policy.FailureClaimed(True, Failed("again")), ["CloseRun", "Exit"], True),
    ("counted, restart mode: a restart round", SETTLING_R1, policy.RestartCounted(1),
     ["ProposeRound"], True),
    ("counted past the budget: close the run", SETTLING_R1, policy.RestartCounted(3),
     ["CloseRun", "Exit"], True),
    ("counted, in place above min: step out, replacements in standby", SETTLING_3,
     policy.RestartCounted(1), ["LeaveRound", "StartInStandby"], True),
    ("counted, in place at min: re-form without our ranks", SETTLING_IN_PLACE,
     policy.RestartCounted(1), ["ReformWithoutUs"], False),
]


@pytest.mark.parametrize(("state", "obs", "actions", "settled"),
                         [case[1:] for case in SETTLE_STEPS],
                         ids=[case[0] for case in SETTLE_STEPS])
def test_each_fact_about_a_failure_takes_the_settling_one_step_further(
        state: AgentState, obs: policy.Observed, actions: list[str], settled: bool) -> None:
    decision = policy.decide(state, obs, SETTINGS)
    assert kinds(decision) == actions
    assert (decision.state.phase is Phase.IDLE and decision.state.failure is None) is settled
    if not settled:
        assert decision.state == state


def test_replacements_started_in_standby_keep_the_lease_and_count_a_restart() -> None:
    step = policy.decide(SETTLING_IN_PLACE, policy.RestartCounted(1), SETTINGS)
    (reform,) = step.actions
    assert isinstance(reform, policy.ReformWithoutUs)
    without = reform.proposal.proposal.round
    assert without.nprocs == (0, 1)
    written = policy.ReformWritten(without, reform.why, current=without, now_ms=6)
    done = policy.decide(step.state, written, SETTINGS)
    assert done.actions == (policy.StartInStandby(without, restart_count=1, first=False,
                                                  register=False),)
    assert done.state.phase is Phase.IDLE
    # A peer's alarm wrote a round with our ranks meanwhile: written without them again.
    theirs = dataclasses.replace(R1, number=2, token=55)
    again = policy.decide(step.state, dataclasses.replace(written, current=theirs), SETTINGS)
    assert kinds(again) == ["ProposeRound", "StartInStandby"]
    proposal = again.actions[0]
    assert isinstance(proposal, policy.ProposeRound)
    assert proposal.proposal.round.nprocs == (0, 1) and proposal.proposal.expected_token == 55


# TORCHELASTIC_RESTART_COUNT: the job's failure count, carried by its rounds ---------------
def restart_counts(decision: policy.Decision) -> list[int]:
    """The failure count each round proposed, or workers started, by ``decision`` carry."""
    counts = []
    for action in decision.actions:
        match action:
            case policy.ProposeRound():
                counts.append(action.proposal.round.restarts)
            case policy.ReformWithoutUs():
                counts.append(action.proposal.proposal.round.restarts)
            case policy.StartWorkers():
                counts.append(action.round.restarts)
            case policy.StartInStandby():
                counts.append(action.restart_count)
    return counts


ABC_1 = dataclasses.replace(round_of("a", "b", "c"), restarts=1)
"""Three members; the job counted one worker failure before this round."""
R1_1 = dataclasses.replace(R1, restarts=1)
RESTART_COUNTS = [
    # (name, state, observation, failure counts carried)
    ("a node lost: the next round keeps the count", dataclasses.replace(RUNNING_R1, round=ABC_1),
     observe(Snapshot(round=ABC_1, nodes=nodes("a", "b"))), [1]),
    ("a node admitted: kept", dataclasses.replace(RUNNING_R1, round=R1_1),
     observe(Snapshot(round=R1_1, nodes=nodes("a", "b", "c"))), [1]),
    ("restart-mode workers started in a new round: its count",
     dataclasses.replace(RUNNING_R1, round=ABC_1),
     observe(Snapshot(round=dataclasses.replace(R2, restarts=1), nodes=nodes("a", "b", "c"))),
     [1]),
    ("a fenced node's rejoin round: kept", dataclasses.replace(FENCED_R1, round=R1_1,
                                                               registered=True),
     observe(Snapshot(round=R1_1, nodes=nodes("a", "b")), WorkerState.IDLE), [1]),
    ("a collective failed, every peer answers: the re-form keeps it",
     dataclasses.replace(RUNNING_R1, round=R1_1), policy.PeersProbed(R1_1, (), (), LOOK), [1]),
    ("a worker failure counted as the job's second: the restart round says 2", SETTLING_R1,
     policy.RestartCounted(2), [2]),
    ("in place above min: the replacements start with it", SETTLING_3,
     policy.RestartCounted(2), [2]),
    ("in place at min: the round without our ranks says it", SETTLING_IN_PLACE,
     policy.RestartCounted(2), [2]),
]


@pytest.mark.parametrize(("state", "obs", "counts"), [case[1:] for case in RESTART_COUNTS],
                         ids=[case[0] for case in RESTART_COUNTS])
def test_a_membership_change_keeps_the_restart_count_and_a_worker_failure_increments_it(
        state: AgentState, obs: policy.Observed, counts: list[int]) -> None:
    assert restart_counts(policy.decide(state, obs, SETTINGS)) == counts


@pytest.mark.parametrize(("dead", "unsure", "workers", "actions"), [
    (("b",), (), WorkerState.RUNNING, []),  # evicted: the next round handles it
    ((), (), WorkerState.RUNNING, ["ProposeRound"]),  # all answer: re-form
    ((), ("b",), WorkerState.RUNNING, ["Sleep"]),  # hung: its lease decides; carry on
    ((), (), WorkerState.FAILED, ["HandleFailure"]),  # our own worker died: settle it
])
def test_an_alarm_is_answered_from_the_probes_outside_any_failure(
        dead: tuple[str, ...], unsure: tuple[str, ...], workers: WorkerState,
        actions: list[str]) -> None:
    look = observe(None, workers, exits=(FAIL,) if workers is WorkerState.FAILED else ())
    decision = policy.decide(RUNNING_R1, policy.PeersProbed(R1, dead, unsure, look), SETTINGS)
    assert kinds(decision) == actions


# a standby worker's failure: replaced in standby, the members undisturbed ------------------
SPARE_SETTINGS = dataclasses.replace(SETTINGS, node_id="c",
                                     limits=Limits(min_nodes=1, max_nodes=2, last_call=5.0))
FULL = Snapshot(round=R1, nodes=nodes("a", "b", "c"), in_process=True)
"""Members a and b; c is registered beyond the maximum: a spare."""
SPARE = AgentState(phase=Phase.STANDBY, round=STANDBY_R1, ever_ran=True)


def spare_decides(state: AgentState, obs: policy.Observed,
                  settings: Settings = SPARE_SETTINGS) -> policy.Decision:
    return policy.decide(state, obs, settings)


def standby_facts(snapshot: Snapshot, node: str = "c") -> FailureFacts:
    return FailureFacts(STANDBY_R1, snapshot, True, FAIL, node, now_ms=5)


@pytest.mark.parametrize("snapshot", [FULL, Snapshot(round=dataclasses.replace(
    round_of("a", "c", number=2, token=70)), nodes=nodes("a", "c"), in_process=True)],
    ids=["waiting as a spare", "a round admitting it"])
def test_a_dead_standby_worker_is_handled_at_once_whatever_the_round(snapshot: Snapshot) -> None:
    look = observe(snapshot, WorkerState.FAILED, exits=(FAIL,), acks=(-1,))
    decision = spare_decides(SPARE, look)
    assert decision.actions == (policy.HandleFailure(STANDBY_R1, (FAIL,)),)


def test_a_standby_worker_killed_before_announcing_is_replaced_not_left_to_restart_mode(
) -> None:
    """Finding 7: "standby workers did not start in time", then workers started afresh in
    every round that listed the node, each importing torch while the members waited."""
    died = policy.StandbyStarted(R1, announced=False, registered=False, exits=(FAIL,))
    decision = spare_decides(AgentState(), died)
    assert decision.actions == (policy.HandleFailure(STANDBY_R1, (FAIL,)),)
    assert decision.state.phase is Phase.STANDBY
    slow = spare_decides(AgentState(), policy.StandbyStarted(R1, announced=False,
                                                             registered=True))
    assert kinds(slow) == ["StopWorkers"]  # too slow, alive: the normal way, as before


def test_a_spares_dead_worker_counts_a_restart_without_a_claim_and_is_replaced_in_standby(
) -> None:
    seen = spare_decides(SPARE, policy.FailureSeen(standby_facts(FULL)))
    assert seen.actions == (policy.CountRestart(),)  # no claim: no round of members failed
    counted = spare_decides(seen.state, policy.RestartCounted(1))
    assert kinds(counted) == ["Unregister", "StartInStandby"]  # no round proposed or left
    assert counted.actions[1] == policy.StartInStandby(R1, restart_count=1, first=False,
                                                       register=True)
    assert counted.state.phase is Phase.IDLE and counted.state.failure is None
    back = spare_decides(counted.state, policy.StandbyStarted(R1, announced=True,
                                                              registered=True))
    assert back.state.phase is Phase.STANDBY and back.actions == ()
    waiting = spare_decides(back.state, observe(FULL, acks=(-1,)))
    assert kinds(waiting) == ["Sleep"]  # a spare again


def test_a_spent_budget_ends_the_spare_alone() -> None:
    seen = spare_decides(SPARE, policy.FailureSeen(standby_facts(FULL)))
    spent = spare_decides(seen.state, policy.RestartCounted(SETTINGS.max_restarts + 1))
    assert kinds(spent) == ["Exit"]  # the run is not closed: its members train on
    exit_ = spent.actions[0]
    assert isinstance(exit_, Exit) and isinstance(exit_.outcome, Failed)
    assert "budget of 2 is spent" in exit_.outcome.reason


def test_a_member_without_ranks_replaces_its_standby_workers_under_its_lease() -> None:
    """At the minimum node count a node replacing its failed workers stays a member with
    no ranks (ReplaceWorkers); a replacement dying in standby keeps it one."""
    without = dataclasses.replace(R1, number=2, nprocs=(0, 1), token=55)
    snapshot = Snapshot(round=without, nodes=nodes("a", "b"), in_process=True)
    outside = dataclasses.replace(without, number=-1)
    state = AgentState(phase=Phase.STANDBY, round=outside, ever_ran=True)
    seen = policy.decide(state, policy.FailureSeen(FailureFacts(
        outside, snapshot, True, FAIL, "a", now_ms=5)), SETTINGS)  # fmt: skip
    counted = policy.decide(seen.state, policy.RestartCounted(1), SETTINGS)
    assert counted.actions == (policy.StartInStandby(without, restart_count=1, first=False,
                                                     register=False),)
    spent = policy.decide(seen.state, policy.RestartCounted(3), SETTINGS)
    assert kinds(spent) == ["CloseRun", "Exit"]


def test_a_standby_worker_failing_as_the_job_finishes_ends_the_spare_finished() -> None:
    seen = spare_decides(SPARE, policy.FailureSeen(standby_facts(
        dataclasses.replace(FULL, completing=True))))
    assert kinds(seen) == ["Exit"] and isinstance(seen.actions[0], Exit)
    assert isinstance(seen.actions[0].outcome, Finished)
