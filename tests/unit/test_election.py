"""The leader's and followers' view of a run, built from a join and watched changes."""

from __future__ import annotations

from elastic_rt.rendezvous.election import RunView
from elastic_rt.rendezvous.kv import Change, KeyValue
from elastic_rt.rendezvous.registry import LEADER, Joined
from elastic_rt.rendezvous.rounds import Limits, NodeInfo, Participate, Propose, Round, decide

PREFIX = "/elastic_rt/run/"
LIMITS = Limits(min_nodes=2, max_nodes=3)


def kv(name: str, value: bytes, revision: int, created: int | None = None) -> KeyValue:
    return KeyValue(PREFIX + name, value, revision, created or revision, lease=7)


def node(name: str, revision: int) -> KeyValue:
    return kv(f"nodes/{name}", NodeInfo(node_id=name, host="h", nproc=1).to_json(), revision)


def put(item: KeyValue) -> Change:
    return Change(item, deleted=False)


def delete(name: str, revision: int) -> Change:
    return Change(kv(name, b"", revision), deleted=True)


def round_kv(members: tuple[str, ...], revision: int, number: int = 0) -> KeyValue:
    value = Round(number, members, (1,) * len(members), ("h",) * len(members)).to_json()
    return kv("round", value, revision)


def leader_view() -> RunView:
    items = {LEADER: kv(LEADER, b"a", 10), "nodes/a": node("a", 10)}
    return RunView(PREFIX, Joined(leader=True, revision=10, items=items))


def follower_view() -> RunView:
    return RunView(PREFIX, Joined(leader=False, revision=12, items={LEADER: kv(LEADER, b"a", 10)}))


def test_the_leader_watches_the_run_and_proposes_when_registrations_arrive() -> None:
    view = leader_view()
    assert view.watch_prefix == PREFIX
    view.apply([put(node("b", 11)), put(node("c", 12))])
    action = decide(view.snapshot(), "a", LIMITS, now=0.0, quorum_since=None)
    assert isinstance(action, Propose)
    assert action.round.members == ("a", "b", "c")  # arrival order: ranks as before


def test_the_leader_sees_a_loss_and_keeps_survivor_ranks() -> None:
    view = leader_view()
    view.apply([put(node("b", 11)), put(node("c", 12)), put(round_kv(("a", "b", "c"), 13))])
    view.apply([delete("nodes/b", 14)])
    action = decide(view.snapshot(), "a", LIMITS, now=0.0, quorum_since=None)
    assert isinstance(action, Propose)
    assert action.round.members == ("a", "c") and action.expected_token == 13


def test_a_follower_watches_the_round_prefix_and_takes_its_place() -> None:
    view = follower_view()
    assert view.watch_prefix == PREFIX + "round" and not view.snapshot().nodes_known
    view.apply([put(round_kv(("a", "b"), 13))])
    action = decide(view.snapshot(), "b", LIMITS, now=0.0, quorum_since=None)
    assert isinstance(action, Participate) and action.round.token == 13


def test_a_follower_sees_the_leader_go() -> None:
    view = follower_view()
    assert not view.leader_gone
    view.apply([delete(LEADER, 20)])
    assert view.leader_gone


def test_older_reads_do_not_revive_a_deleted_or_overwrite_a_newer_key() -> None:
    view = follower_view()
    view.apply([delete(LEADER, 20), put(round_kv(("a",), 22, number=2))])
    lost_claim = Joined(leader=False, revision=19,
                        items={LEADER: kv(LEADER, b"a", 10), "round": round_kv(("a",), 18)})
    view.merge(lost_claim)
    assert view.leader_gone
    snapshot = view.snapshot()
    assert snapshot.round is not None and snapshot.round.number == 2


def test_a_change_is_applied_once() -> None:
    view = follower_view()
    view.apply([put(round_kv(("a",), 13, number=1))])
    view.apply([put(round_kv(("a",), 13, number=5))])  # a replay of revision 13
    snapshot = view.snapshot()
    assert snapshot.round is not None and snapshot.round.number == 1


def test_the_leader_reads_which_round_trained_last_from_the_runs_progress() -> None:
    """Rank 0's ``progress`` key says the round of the last step; an in-process admission
    waits for it (``rounds.decide``). A follower's view does not hold it."""
    view = leader_view()
    view.apply([put(node("b", 11)), put(round_kv(("a", "b"), 12, number=4)),
                put(kv("round-in-process", b"1", 12))])
    assert view.snapshot().trained_round == -1
    view.apply([put(node("c", 13))])
    current = view.snapshot().round
    assert current is not None
    assert decide(view.snapshot(), "a", LIMITS, now=0.0, quorum_since=None) == Participate(current)
    view.apply([put(kv("progress", b'{"round": 4, "step": 9}', 14))])
    assert view.snapshot().trained_round == 4
    action = decide(view.snapshot(), "a", LIMITS, now=0.0, quorum_since=None)
    assert isinstance(action, Propose) and action.round.members == ("a", "b", "c")
    assert follower_view().snapshot().trained_round is None
