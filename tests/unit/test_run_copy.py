"""A node's copy of its run without IO (agents/run_copy.py), and the requests it sends.

RunCopy is what the agent's blocking RunWatch and the swarm's asyncio AioRunWatch
share, so its decisions are checked here once, on plain data: which watch's events
count, when a read must send a claim first, what a claim's answer and a proposal's
outcome change. The requests are the registry's, built without a client
(RunRequests), and a round's value is decoded once per process (decoded_round).
"""

from __future__ import annotations

from elastic_rt.rendezvous.kv import Change, Get, KeyValue, Put, TxnResult
from elastic_rt.rendezvous.registry import LEADER, ROUND, Joined, RunRequests, decoded_round
from elastic_rt.rendezvous.rounds import NodeInfo, Propose, Round

from agents.run_copy import RunCopy, needs_registrations

PREFIX = "/elastic_rt/run/"


def kv(name: str, value: bytes, revision: int) -> KeyValue:
    return KeyValue(PREFIX + name, value, revision, revision, lease=7)


def a_round(members: tuple[str, ...], number: int = 0) -> Round:
    return Round(number, members, (1,) * len(members), ("h",) * len(members))


def follower(revision: int = 12, *, leader: bool = True) -> Joined:
    items = {LEADER: kv(LEADER, b"a", 10)} if leader else {}
    return Joined(leader=False, revision=revision, items=items)


def test_a_follow_watches_from_the_next_revision_and_cancels_the_view_before() -> None:
    copy = RunCopy(PREFIX)
    first, stale = copy.follow(follower(12))
    assert (first.prefix, first.start_revision, stale) == (PREFIX + "round", 13, None)
    cancelled: list[str] = []
    assert copy.armed(first.generation, lambda: cancelled.append("first")) is None
    second, stale = copy.follow(Joined(leader=True, revision=20, items={}))
    assert second.prefix == PREFIX and stale is not None  # the leader watches the whole run
    stale()
    assert cancelled == ["first"]
    late = copy.armed(first.generation, lambda: cancelled.append("late"))
    assert late is not None  # armed after a newer view replaced it: cancel at once


def test_events_of_a_replaced_view_are_dropped() -> None:
    copy = RunCopy(PREFIX)
    old, _ = copy.follow(follower(12))
    new, _ = copy.follow(follower(12))
    written = kv(ROUND, a_round(("a", "b")).to_json(), 13)
    assert not copy.changed(old.generation, [Change(written, deleted=False)])
    assert copy.snapshot().round is None
    assert copy.changed(new.generation, [Change(written, deleted=False)])
    held = copy.snapshot().round
    assert held is not None and (held.members, held.token) == (("a", "b"), 13)


def test_a_broken_watch_makes_the_next_read_claim_and_follow_its_answer() -> None:
    copy = RunCopy(PREFIX)
    wanted, _ = copy.follow(follower(12))
    assert copy.is_current and copy.refresh() is None
    assert copy.changed(wanted.generation, None)  # the stream broke
    assert not copy.is_current
    refresh = copy.refresh()
    assert refresh is not None and refresh.resync and refresh.held == 0
    assert copy.claimed(refresh, follower(30))  # follow it, even as a follower


def test_a_vanished_leader_makes_followers_claim_and_the_losers_merge() -> None:
    copy = RunCopy(PREFIX)
    wanted, _ = copy.follow(follower(12))
    copy.changed(wanted.generation, [Change(kv(LEADER, b"", 13), deleted=True)])
    refresh = copy.refresh()
    assert refresh is not None and not refresh.resync
    newer = {ROUND: kv(ROUND, a_round(("b",), 1).to_json(), 14), LEADER: kv(LEADER, b"b", 14)}
    assert not copy.claimed(refresh, Joined(leader=False, revision=14, items=newer))
    held = copy.snapshot().round
    assert held is not None and held.members == ("b",)
    assert copy.refresh() is None  # the new leader's key is held again
    assert copy.claimed(refresh, Joined(leader=True, revision=15, items={}))


def test_a_lost_proposal_waits_for_the_winners_round_and_a_won_one_is_held_at_once() -> None:
    copy = RunCopy(PREFIX)
    wanted, _ = copy.follow(Joined(leader=True, revision=12, items={
        LEADER: kv(LEADER, b"a", 10), ROUND: kv(ROUND, a_round(("a",)).to_json(), 11)}))
    proposal = Propose(a_round(("a", "b"), 1), expected_token=11)
    copy.proposed(proposal, None)
    assert not copy.ready and not copy.is_current  # the copy still holds the round it lost on
    copy.changed(wanted.generation, [Change(kv(ROUND, a_round(("a", "c"), 1).to_json(), 13),
                                            deleted=False)])
    assert copy.ready
    won = Round(2, ("a", "c", "b"), (1, 1, 1), ("h",) * 3, token=20)
    copy.proposed(Propose(won, expected_token=13), won)
    assert copy.snapshot().round == won


def test_a_completing_job_needs_the_registrations_only_on_a_followers_copy() -> None:
    copy = RunCopy(PREFIX)
    wanted, _ = copy.follow(follower(12))
    copy.changed(wanted.generation, [Change(kv("round-completing", b"1", 13), deleted=False)])
    assert not copy.is_current and needs_registrations(copy.snapshot())
    leader = RunCopy(PREFIX)
    leader.follow(Joined(leader=True, revision=12, items={
        LEADER: kv(LEADER, b"a", 10), "round-completing": kv("round-completing", b"1", 11)}))
    assert leader.is_current and not needs_registrations(leader.snapshot())


def test_the_join_transaction_registers_claims_and_reads_as_data() -> None:
    requests = RunRequests("run")
    info = NodeInfo(node_id="a", host="h", nproc=1)
    join = requests.join_request(info, 7)
    assert join.expect == {PREFIX + LEADER: 0}
    register = Put(PREFIX + "nodes/a", info.to_json(), 7)
    assert join.success == (Put(PREFIX + LEADER, b"a", 7), register, Get(PREFIX, prefix=True))
    assert join.failure == (register, Get(PREFIX + "round", prefix=True))
    assert requests.claim_request("a", 7, held=5).expect == {PREFIX + LEADER: 5}
    joined = requests.joined(TxnResult(False, 9, [[kv(ROUND, b"{}", 8)]]))
    assert joined == Joined(False, 9, {ROUND: kv(ROUND, b"{}", 8)})


def test_a_proposal_is_a_compare_on_the_round_it_saw() -> None:
    requests = RunRequests("run")
    proposal = Propose(a_round(("a", "b"), 1), expected_token=11)
    write = requests.propose_request(proposal)
    assert (write.key, write.expect) == (PREFIX + ROUND, {PREFIX + ROUND: 11})
    assert Round.from_json(write.value) == proposal.round
    assert requests.proposed(proposal, None) is None
    assert requests.proposed(proposal, 12) == Round(1, ("a", "b"), (1, 1), ("h", "h"), token=12)


def test_a_rounds_value_is_decoded_once_and_checked_byte_for_byte() -> None:
    value = a_round(("a", "b")).to_json()
    first = decoded_round(value, 40)
    assert decoded_round(bytes(bytearray(value)), 40) is first  # the same round, shared
    other = a_round(("a", "c")).to_json()
    assert decoded_round(other, 40).members == ("a", "c")  # same revision, other bytes
    assert decoded_round(value, 41).token == 41
