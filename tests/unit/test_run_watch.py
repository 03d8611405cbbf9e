"""A node's copy of its run (agents/run_watch.py) on a real etcd: the decisions it feeds.

The protocol's pure parts are tested in test_rounds.py and test_election.py; these
check what only a store shows: who the join transaction makes leader, what each
node's watch brings (a registration lost or added, a round written by another), a
proposal that loses the compare, a node that rejoins on a new lease after it was
fenced, and a follower that takes the leadership over. Each test is a few nodes on
the session's etcd and takes well under a second.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Callable, Iterator

import pytest

from agents import policy
from agents.inbox import Inbox
from agents.run_watch import RunWatch
from elastic_rt.errors import FencedOutError
from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import wait_until
from elastic_rt.rendezvous import rounds
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import FAILURE_CLAIMS_KEPT, RunRegistry
from elastic_rt.rendezvous.rounds import Limits, NodeInfo, Propose, Round, Snapshot

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(30)]

LIMITS = Limits(min_nodes=2, max_nodes=3, last_call=0.0)
SETTINGS = policy.Settings(node_id="unused", limits=LIMITS, retry_after=timedelta(seconds=2))


class Node:
    """One node's RunWatch on its own client and lease, as an agent holds it."""

    def __init__(self, kv: EtcdKV, run_id: str, node_id: str) -> None:
        self.kv = kv
        self.node_id = node_id
        self.watch = RunWatch(RunRegistry(kv, run_id), Inbox())
        self.lease = 0

    def join(self) -> "Node":
        self.lease = self.kv.grant_lease(10)
        self.watch.join(NodeInfo(node_id=self.node_id, host="h", nproc=1), self.lease)
        return self

    def read(self) -> Snapshot:
        snapshot, store_error = self.watch.read(policy.AgentState(), SETTINGS)
        assert snapshot is not None and not store_error
        return snapshot

    def seen(self, condition: Callable[[Snapshot], bool], what: str) -> Snapshot:
        """The first snapshot (from the watched copy) for which ``condition`` holds."""
        return wait_until(lambda: (lambda s: s if condition(s) else None)(self.read()), 5,
                          f"{self.node_id} to see {what}", interval=0.02)

    def decide(self) -> rounds.Action:
        return rounds.decide(self.read(), self.node_id, LIMITS, now=0.0, quorum_since=0.0)


@pytest.fixture()
def nodes(etcd_server: EtcdServer) -> Iterator[Callable[[str], Node]]:
    """Nodes on one run of the session etcd; every watch and client closed after."""
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    made: list[Node] = []

    def make(node_id: str) -> Node:
        node = Node(EtcdKV(etcd_server.endpoint), run_id, node_id)
        made.append(node)
        return node

    yield make
    for node in made:
        node.watch.close()
        if node.lease:
            node.kv.revoke_lease(node.lease)
        node.kv.close()


def _formed(leader: Node, *followers: Node) -> Round:
    """The leader proposes once it sees every node; every node holds the round."""
    names = {leader.node_id, *(f.node_id for f in followers)}
    leader.seen(lambda s: set(s.nodes) == names, "every registration")
    action = leader.decide()
    assert isinstance(action, Propose), action
    written = leader.watch.propose(action)
    assert written is not None
    for node in (leader, *followers):
        node.seen(lambda s: s.round is not None and s.round.token == written.token,
                  "the round")
    return written


def test_the_first_to_join_leads_and_only_it_knows_the_registrations(nodes) -> None:
    a, b = nodes("a").join(), nodes("b").join()
    assert a.watch.is_leader and not b.watch.is_leader
    assert b.read().nodes_known is False and b.read().nodes == {}
    assert isinstance(b.decide(), rounds.Wait)  # a follower never proposes
    round_ = _formed(a, b)
    assert round_.members == ("a", "b")  # arrival order
    assert isinstance(b.decide(), rounds.Participate)
    assert b.watch.is_current  # the round came by the watch: no read was needed


def test_the_leader_sees_a_loss_and_the_survivors_keep_their_ranks(nodes) -> None:
    a, b, c = nodes("a").join(), nodes("b").join(), nodes("c").join()
    first = _formed(a, b, c)
    b.kv.revoke_lease(b.lease)  # as an agent evicts a peer whose liveness socket refuses
    b.lease = 0
    a.seen(lambda s: "b" not in s.nodes, "b's registration go")
    action = a.decide()
    assert isinstance(action, Propose) and action.expected_token == first.token
    assert action.round.members == ("a", "c")
    written = a.watch.propose(action)
    assert written is not None
    assert c.seen(lambda s: s.round is not None and s.round.number == 1, "round 1").round \
        == written


def test_the_leader_admits_a_newcomer_after_the_members(nodes) -> None:
    a, b = nodes("a").join(), nodes("b").join()
    first = _formed(a, b)
    c = nodes("c").join()
    a.seen(lambda s: "c" in s.nodes, "c's registration")
    action = a.decide()
    assert isinstance(action, Propose) and action.expected_token == first.token
    assert action.round.members == ("a", "b", "c")
    assert a.watch.propose(action) is not None
    assert isinstance(c.seen(lambda s: s.round is not None and s.round.number == 1,
                             "round 1 admitting it") and c.decide(), rounds.Participate)


def test_a_stale_proposal_loses_the_compare_and_the_next_read_has_the_winner(nodes) -> None:
    a, b = nodes("a").join(), nodes("b").join()
    first = _formed(a, b)
    stale = rounds.restart_round(first, "the same failure, seen late", 0)  # first's token
    won = a.watch.propose(rounds.restart_round(first, "a worker failed", 0))
    assert won is not None
    assert b.watch.propose(stale) is None  # fenced by the compare on the round's revision
    assert b.read().round == won  # the read waited for the watch to bring the winner's round


def test_a_loser_that_already_holds_the_winner_does_not_wait(nodes) -> None:
    a, b = nodes("a").join(), nodes("b").join()
    first = _formed(a, b)
    won = a.watch.propose(rounds.restart_round(first, "a worker failed", 0))
    assert won is not None
    b.seen(lambda s: s.round == won, "the winner's round")
    assert b.watch.propose(rounds.restart_round(first, "seen late", 0)) is None
    assert b.watch.is_current  # nothing to wait for: its copy has the round that won


def test_a_fenced_node_rejoins_on_a_new_lease_and_restarts_its_round(nodes) -> None:
    a, b = nodes("a").join(), nodes("b").join()
    first = _formed(a, b)
    old_lease = b.lease
    b.kv.revoke_lease(old_lease)  # its lease ended: the node is fenced
    a.seen(lambda s: "b" not in s.nodes, "b's registration go")
    b.join()  # what the agent does after a fence: a new lease, the same join
    assert b.lease != old_lease and not b.watch.is_leader
    assert a.seen(lambda s: "b" in s.nodes, "b registered again").nodes["b"].lease == b.lease
    assert b.read().round == first  # the new view holds the round; the old watch is gone
    # The rejoining node asks for a restart of its round (agents/policy/running.py), on a compare:
    written = b.watch.propose(rounds.restart_round(first, "b rejoined after a fence", 0))
    assert written is not None and written.members == first.members  # ranks kept
    assert a.seen(lambda s: s.round is not None and s.round.number == 1, "round 1").round \
        == written
    with pytest.raises(FencedOutError):  # what round 0's workers commit now is refused
        b.watch.registry.commit_fenced("checkpoint", b"step-9", first.token)


def test_a_follower_takes_over_when_the_leaders_lease_ends(nodes) -> None:
    a, b, c = nodes("a").join(), nodes("b").join(), nodes("c").join()
    first = _formed(a, b, c)
    a.watch.close()
    a.kv.revoke_lease(a.lease)  # the leader key goes with its lease
    a.lease = 0
    # Each follower reads once its watch shows the key gone: one claim each, one wins.
    wait_until(lambda: [n.read() for n in (b, c)] and (b.watch.is_leader or c.watch.is_leader),
               5, "a new leader", interval=0.02)
    leader, other = (b, c) if b.watch.is_leader else (c, b)
    assert not other.watch.is_leader
    run = leader.seen(lambda s: s.nodes_known and "a" not in s.nodes, "the run read in")
    assert set(run.nodes) == {"b", "c"}
    proposal = leader.decide()
    assert isinstance(proposal, Propose) and proposal.expected_token == first.token
    assert proposal.round.members == tuple(m for m in first.members if m != "a")


def test_a_new_rounds_store_replaces_older_rounds_keys(etcd_kv) -> None:
    """One key a round stayed for the life of the job: a soak left 268 ``store/<k>``."""
    registry = RunRegistry(etcd_kv, f"keys-{uuid.uuid4().hex[:8]}")
    kept = FAILURE_CLAIMS_KEPT
    for number in range(-1, kept + 3):  # a standby worker's claim is for round -1
        assert registry.claim_failure(number, "worker exited 1")
        registry.publish_store(Round(number, ("a",), (1,), ("h",)), f"h:{1000 + number}")
    newest = kept + 2
    assert registry.store_address(newest) == f"h:{1000 + newest}"
    assert registry.store_address(newest - 1) is None
    claims = etcd_kv.get_prefix(registry.key("failure/"))
    assert sorted(int(c.key.rsplit("/", 1)[1]) for c in claims) == list(range(newest - kept,
                                                                              newest + 1))
    assert not registry.claim_failure(newest - kept, "reported late")  # still counted once
