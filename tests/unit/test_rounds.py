"""The pure round decisions: who forms which round, when, and with which ranks."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_rt.errors import StoreStateError
from elastic_rt.rendezvous.rounds import (
    SPARE,
    Closed,
    Limits,
    NodeInfo,
    Participate,
    Propose,
    Round,
    Snapshot,
    Wait,
    decide,
    is_paused,
    next_members,
    restart_round,
    without,
)
from tests.fixtures.clock import FakeClock

LIMITS = Limits(min_nodes=2, max_nodes=4, last_call=5.0)


def nodes(*names: str, nproc: int = 1) -> dict[str, NodeInfo]:
    """Nodes that arrived in the order given."""
    return {
        name: NodeInfo(node_id=name, host=f"h-{name}", nproc=nproc, joined_revision=10 + i)
        for i, name in enumerate(names)
    }


def round_of(*members: str, number: int = 0, token: int = 50) -> Round:
    return Round(
        number=number,
        members=members,
        nprocs=(1,) * len(members),
        hosts=tuple(f"h-{m}" for m in members),
        token=token,
    )


def decide_at(clock: FakeClock, snapshot: Snapshot, me: str, *, quorum_since: float | None = None,
              limits: Limits = LIMITS):  # type: ignore[no-untyped-def]
    return decide(snapshot, me, limits, now=clock(), quorum_since=quorum_since, now_ms=clock.now_ms)


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


# first round -----------------------------------------------------------------------
def test_first_round_waits_below_min(clock: FakeClock) -> None:
    action = decide_at(clock, Snapshot(round=None, nodes=nodes("a")), "a")
    assert isinstance(action, Wait)
    assert action.quorum_since is None
    assert not action.stop_workers


def test_first_round_forms_at_once_when_max_nodes_registered(clock: FakeClock) -> None:
    action = decide_at(clock, Snapshot(round=None, nodes=nodes("c", "a", "d", "b")), "a")
    assert isinstance(action, Propose)
    assert action.expected_token == 0
    assert action.round.number == 0
    assert action.round.members == ("c", "a", "d", "b")  # arrival order
    assert action.round.hosts == ("h-c", "h-a", "h-d", "h-b")
    assert action.round.created_ms == clock.now_ms


def test_first_round_takes_only_max_nodes_in_arrival_order(clock: FakeClock) -> None:
    action = decide_at(clock, Snapshot(round=None, nodes=nodes(*"abcdef")), "f")
    assert isinstance(action, Propose)
    assert action.round.members == ("a", "b", "c", "d")


def test_last_call_window_opens_at_min_and_forms_when_it_ends(clock: FakeClock) -> None:
    snapshot = Snapshot(round=None, nodes=nodes("a", "b"))
    first = decide_at(clock, snapshot, "a")
    assert isinstance(first, Wait)
    assert first.quorum_since == clock()

    clock.advance(LIMITS.last_call - 0.1)
    still = decide_at(clock, snapshot, "a", quorum_since=first.quorum_since)
    assert isinstance(still, Wait)
    assert still.quorum_since == first.quorum_since  # the window does not restart

    clock.advance(0.1)
    formed = decide_at(clock, snapshot, "a", quorum_since=first.quorum_since)
    assert isinstance(formed, Propose)
    assert formed.round.members == ("a", "b")
    assert formed.expected_token == 0


def test_max_nodes_arriving_during_last_call_form_at_once(clock: FakeClock) -> None:
    since = clock()
    clock.advance(1.0)
    action = decide_at(clock, Snapshot(round=None, nodes=nodes(*"abcd")), "b", quorum_since=since)
    assert isinstance(action, Propose)


def test_node_ids_break_ties_in_arrival_order() -> None:
    same = {n: NodeInfo(node_id=n, host="h", nproc=1, joined_revision=7) for n in ("z", "y", "x")}
    assert next_members(None, same, 10) == ("x", "y", "z")


def test_nprocs_and_global_ranks_follow_member_order(clock: FakeClock) -> None:
    registered = nodes("a", "b")
    registered["b"] = NodeInfo(node_id="b", host="h-b", nproc=3, joined_revision=11)
    registered["a"] = NodeInfo(node_id="a", host="h-a", nproc=2, joined_revision=10)
    action = decide(Snapshot(round=None, nodes=registered), "a", Limits(min_nodes=2, max_nodes=2),
                    now=clock(), quorum_since=None)  # fmt: skip
    assert isinstance(action, Propose)
    assert action.round.nprocs == (2, 3)
    assert action.round.world_size == 5
    assert action.round.rank_offset("b") == 2
    assert action.round.group_rank("b") == 1


# a running round --------------------------------------------------------------------
def test_members_participate_in_an_intact_full_round(clock: FakeClock) -> None:
    current = round_of(*"abcd")
    action = decide_at(clock, Snapshot(round=current, nodes=nodes(*"abcd")), "c")
    assert action == Participate(current)


def test_spare_waits_while_the_round_is_full(clock: FakeClock) -> None:
    current = round_of(*"abcd")
    snapshot = Snapshot(round=current, nodes=nodes(*"abcde"))
    spare = decide_at(clock, snapshot, "e")
    assert isinstance(spare, Wait)
    assert not spare.stop_workers
    assert decide_at(clock, snapshot, "a") == Participate(current)
    assert spare == Wait(SPARE)
    # a follower (it holds no registrations) tells the same from the round's size
    follower = decide_at(clock, Snapshot(round=current, nodes={}, nodes_known=False), "e")
    assert follower == Wait(SPARE)
    small = decide_at(clock, Snapshot(round=round_of(*"ab"), nodes={}, nodes_known=False), "e")
    assert isinstance(small, Wait) and small.reason != SPARE  # it is admitted next


def test_lost_member_gives_next_round_with_survivors_in_order_then_newcomers(
    clock: FakeClock,
) -> None:
    current = round_of("d", "b", "a", "c", number=3, token=77)
    # "b" is gone; "e" and "f" wait, "f" arrived first.
    registered = nodes("f", "e", "d", "a", "c")
    for me in ("d", "a", "f"):  # members and waiting nodes all agree on the proposal
        action = decide_at(clock, Snapshot(round=current, nodes=registered), me)
        assert isinstance(action, Propose)
        assert action.expected_token == 77
        assert action.round.number == 4
        assert action.round.members == ("d", "a", "c", "f")
        assert "lost b" in action.round.reason


def test_survivor_ranks_keep_their_relative_order(clock: FakeClock) -> None:
    current = round_of(*"abcd")
    action = decide_at(clock, Snapshot(round=current, nodes=nodes("a", "c", "d")), "a")
    assert isinstance(action, Propose)
    new = action.round
    survivors = [m for m in current.members if m in new.members]
    assert [new.group_rank(m) for m in survivors] == sorted(new.group_rank(m) for m in survivors)
    assert new.members == ("a", "c", "d")


def test_waiting_node_is_admitted_while_the_round_has_room(clock: FakeClock) -> None:
    current = round_of("a", "b", token=9)
    action = decide_at(clock, Snapshot(round=current, nodes=nodes("a", "b", "c")), "a")
    assert isinstance(action, Propose)
    assert action.round.members == ("a", "b", "c")
    assert action.round.number == current.number + 1
    assert action.expected_token == 9
    assert "admitting c" in action.round.reason


def test_fewer_than_min_survivors_are_written_as_a_paused_round(clock: FakeClock) -> None:
    # Only the leader sees the loss; the paused round is how followers hear of it.
    current = round_of("a", "b", "c", number=4, token=50)
    action = decide_at(clock, Snapshot(round=current, nodes=nodes("c")), "c",
                       limits=Limits(min_nodes=2, max_nodes=4))
    assert isinstance(action, Propose) and action.expected_token == 50
    assert action.round.number == 5 and action.round.members == ("c",)
    assert action.round.reason.startswith("paused: 1 of at least 2")


def test_members_of_a_paused_round_wait_and_stop_their_workers(clock: FakeClock) -> None:
    paused = round_of("a", number=5)
    leader = decide_at(clock, Snapshot(round=paused, nodes=nodes("a")), "a")
    follower = decide_at(clock, Snapshot(round=paused, nodes={}, nodes_known=False), "a")
    outsider = decide_at(clock, Snapshot(round=paused, nodes={}, nodes_known=False), "q")
    assert isinstance(leader, Wait) and leader.stop_workers
    assert isinstance(follower, Wait) and follower.stop_workers
    assert isinstance(outsider, Wait) and not outsider.stop_workers


def test_a_paused_round_resumes_with_survivors_first_once_min_are_back(clock: FakeClock) -> None:
    paused = round_of("c", "a", number=5, token=60)
    action = decide_at(clock, Snapshot(round=paused, nodes=nodes("a", "b", "c")), "a",
                       limits=Limits(min_nodes=3, max_nodes=4))
    assert isinstance(action, Propose) and action.expected_token == 60
    assert action.round.members == ("c", "a", "b") and action.round.number == 6
    assert action.round.reason == "resumed with 3 nodes"


def test_a_newcomer_restores_quorum_after_a_loss(clock: FakeClock) -> None:
    current = round_of("a", "b")
    action = decide_at(clock, Snapshot(round=current, nodes=nodes("a", "z")), "z")
    assert isinstance(action, Propose)
    assert action.round.members == ("a", "z")


# finishing --------------------------------------------------------------------------
def test_closed_job_closes_everyone(clock: FakeClock) -> None:
    snapshot = Snapshot(round=round_of("a", "b"), nodes=nodes("a", "b"), closed="finished")
    assert decide_at(clock, snapshot, "a") == Closed("finished")
    assert decide_at(clock, Snapshot(round=None, nodes={}, closed="failed: x"), "q") == Closed(
        "failed: x"
    )


def test_completing_job_keeps_members_and_turns_others_away(clock: FakeClock) -> None:
    current = round_of("a", "b")
    # Even with "b" lost, a finishing job forms no new round.
    snapshot = Snapshot(round=current, nodes=nodes("a", "c"), completing=True)
    assert decide_at(clock, snapshot, "a") == Participate(current)
    assert isinstance(decide_at(clock, snapshot, "c"), Closed)


# restarts and records -------------------------------------------------------------------
# followers of the leader (nodes_known=False) ------------------------------------------
def follower_view(round_: Round | None, **kw: object) -> Snapshot:
    return Snapshot(round=round_, nodes={}, nodes_known=False, **kw)  # type: ignore[arg-type]


def test_a_follower_never_proposes_the_first_round(clock: FakeClock) -> None:
    action = decide_at(clock, follower_view(None), "a", quorum_since=clock() - 60)
    assert isinstance(action, Wait) and "leader" in action.reason


def test_a_follower_takes_part_in_a_round_that_lists_it_without_seeing_losses(
    clock: FakeClock
) -> None:
    # b is gone, but only the leader sees registrations: it proposes the next round.
    current = round_of("a", "b", "c")
    assert decide_at(clock, follower_view(current), "c") == Participate(current)


def test_a_follower_outside_the_round_waits_to_be_admitted(clock: FakeClock) -> None:
    action = decide_at(clock, follower_view(round_of("a", "b")), "c")
    assert isinstance(action, Wait) and not action.stop_workers


def test_closed_and_completing_reach_followers_too(clock: FakeClock) -> None:
    assert isinstance(decide_at(clock, follower_view(None, closed="done"), "a"), Closed)
    current = round_of("a", "b")
    assert decide_at(clock, follower_view(current, completing=True), "a") == Participate(current)
    assert isinstance(decide_at(clock, follower_view(current, completing=True), "z"), Closed)


def test_restart_round_keeps_members_and_bumps_the_number() -> None:
    current = round_of("b", "a", number=2, token=41)
    proposal = restart_round(current, "worker failed", now_ms=123)
    assert proposal.expected_token == 41
    assert proposal.round.number == 3
    assert proposal.round.members == current.members
    assert proposal.round.hosts == current.hosts
    assert proposal.round.nprocs == current.nprocs
    assert proposal.round.reason == "worker failed"
    assert proposal.round.created_ms == 123


def test_only_a_counted_failure_changes_the_restart_count_rounds_carry(clock: FakeClock) -> None:
    current = dataclasses.replace(round_of("a", "b", "c"), restarts=2)
    assert restart_round(current, "re-form", now_ms=1).round.restarts == 2
    assert restart_round(current, "worker failed", now_ms=1, restarts=3).round.restarts == 3
    lost = decide_at(clock, Snapshot(round=current, nodes=nodes("a", "b")), "a")
    admitting = decide_at(clock, Snapshot(round=current, nodes=nodes("a", "b", "c", "d")), "a")
    assert isinstance(lost, Propose) and isinstance(admitting, Propose)
    assert (lost.round.restarts, admitting.round.restarts) == (2, 2)


def test_a_node_leaving_is_dropped_and_the_others_keep_their_order() -> None:
    current = dataclasses.replace(round_of("a", "b", "c", number=3), nprocs=(1, 2, 1),
                                  restarts=2)
    proposal = without(current, "b", "b left: preempted", 99, LIMITS)
    assert proposal.expected_token == current.token
    assert (proposal.round.number, proposal.round.members, proposal.round.nprocs,
            proposal.round.hosts) == (4, ("a", "c"), (1, 1), ("h-a", "h-c"))
    assert (proposal.round.reason, proposal.round.created_ms, proposal.round.restarts) == (
        "b left: preempted", 99, 2)


def test_a_node_leaving_below_min_writes_a_paused_round() -> None:
    proposal = without(round_of("a", "b"), "a", "a left: SIGTERM", 0, LIMITS)
    assert proposal.round.members == ("b",)
    assert proposal.round.reason.startswith("paused: 1 of at least 2 nodes left")
    assert is_paused(proposal.round, LIMITS)


def test_round_and_node_records_round_trip_through_json() -> None:
    current = dataclasses.replace(round_of("a", "b", number=5, token=0), restarts=2)
    assert Round.from_json(current.to_json(), token=8) == dataclasses.replace(current, token=8)
    written_before_the_count = b'{"number": 1, "members": ["a"], "nprocs": [1], "hosts": ["h"]}'
    assert Round.from_json(written_before_the_count).restarts == 0
    info = NodeInfo(node_id="a", host="h", nproc=2, alive_addr="127.0.0.1:9")
    assert NodeInfo.from_json(info.to_json(), joined_revision=3, lease=4) == NodeInfo(
        node_id="a", host="h", nproc=2, alive_addr="127.0.0.1:9", joined_revision=3, lease=4
    )


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"\xff"])
def test_a_corrupt_record_is_a_store_state_error(raw: bytes) -> None:
    with pytest.raises(StoreStateError):
        Round.from_json(raw)


# admissions wait for a round that trained ---------------------------------------------
@pytest.mark.parametrize("trained_round, admits", [(-1, False), (2, False), (3, True),
                                                   (None, True)])
def test_an_in_process_admission_waits_until_the_current_round_has_trained(
    clock: FakeClock, trained_round: int | None, admits: bool
) -> None:
    """A newcomer is admitted once round 3's ranks completed a step: a newer round formed
    while they still join would split them (the soak's 24 s stall). None: not known (a
    follower's view), nothing held back."""
    current = round_of("a", "b", number=3)
    snapshot = Snapshot(round=current, nodes=nodes("a", "b", "c"), in_process=True,
                        trained_round=trained_round)
    action = decide_at(clock, snapshot, "a")
    if admits:
        assert isinstance(action, Propose) and action.round.members == ("a", "b", "c")
    else:
        assert action == Participate(current)
        assert isinstance(decide_at(clock, snapshot, "c"), Wait)


def test_a_loss_or_restart_mode_is_never_held_back_by_an_untrained_round(
    clock: FakeClock
) -> None:
    lost = Snapshot(round=round_of("a", "b", "c", number=3), nodes=nodes("a", "b", "d"),
                    in_process=True, trained_round=2)
    action = decide_at(clock, lost, "a")
    assert isinstance(action, Propose) and action.round.members == ("a", "b", "d")
    restarts = dataclasses.replace(lost, round=round_of("a", "b", number=3),
                                   nodes=nodes("a", "b", "c"), in_process=False)
    action = decide_at(clock, restarts, "a")
    assert isinstance(action, Propose) and action.round.members == ("a", "b", "c")


def test_in_process_members_keep_their_ranks_when_a_round_admits_or_loses(
    clock: FakeClock
) -> None:
    """b's workers are being replaced (no ranks): an admission or a loss keeps it so,
    since the round would otherwise wait for the replacements' import (b asks for its
    ranks back itself once they are ready). A resumed paused round starts every worker
    anew, and in restart mode every round does: those take the registered ranks."""
    current = dataclasses.replace(round_of("a", "b", "c", number=3), nprocs=(1, 0, 1))
    admitting = Snapshot(round=current, nodes=nodes("a", "b", "c", "d"), in_process=True,
                         trained_round=3)
    action = decide_at(clock, admitting, "a")
    assert isinstance(action, Propose) and action.round.nprocs == (1, 0, 1, 1)
    losing = dataclasses.replace(admitting, nodes=nodes("a", "b"))
    action = decide_at(clock, losing, "a")
    assert isinstance(action, Propose) and action.round.nprocs == (1, 0)
    restarting = dataclasses.replace(admitting, in_process=False)
    action = decide_at(clock, restarting, "a")
    assert isinstance(action, Propose) and action.round.nprocs == (1, 1, 1, 1)
    paused = dataclasses.replace(current, members=("b",), nprocs=(0,), hosts=("h-b",))
    resumed = dataclasses.replace(admitting, round=paused, nodes=nodes("b", "d"))
    action = decide_at(clock, resumed, "b")
    assert isinstance(action, Propose) and action.round.nprocs == (1, 1)
