"""Rendezvous against a real etcd: many simulated nodes (threads) in one process.

Each :class:`~agents.sim.simulated.SimulatedNode` has its own etcd client and lease
keeper and runs the agent's own decisions (agents/policy/, agents/dispatch.py); only the
workers are missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta
from typing import Any, Callable, Iterator

import pytest

from agents.sim.simulated import SimulatedNode, start_nodes, stop_nodes
from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import WaitTimeout, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import Closed, Limits, NodeInfo, Round, Wait, without

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

Starter = Callable[..., list[SimulatedNode]]
LIMITS_2_3 = Limits(min_nodes=2, max_nodes=3, last_call=0.2)


@pytest.fixture()
def start(etcd_server: EtcdServer) -> Iterator[Starter]:
    """Start simulated nodes on the session etcd; all are stopped in teardown."""
    started: list[SimulatedNode] = []

    def _start(
        run_id: str, names: list[str], limits: Limits, **kwargs: Any
    ) -> list[SimulatedNode]:
        nodes = start_nodes(etcd_server.endpoint, run_id, names, limits, **kwargs)
        started.extend(nodes)
        return nodes

    yield _start
    stop_nodes(started)


def agreed_round(nodes: list[SimulatedNode], predicate: Callable[[Round], bool],
                 timeout: float = 15) -> Round:
    """The round every node reached; asserts they all hold the same one."""
    seen = [node.wait_for_round(predicate, timeout) for node in nodes]
    assert len({(r.number, r.members, r.token) for r in seen}) == 1, seen
    return seen[0]


def test_eight_nodes_form_one_round_with_one_writer_and_ranks_by_arrival(
    start: Starter, etcd_kv: EtcdKV, run_id: str
) -> None:
    names = [f"node-{i}" for i in range(8)]
    nodes = start(run_id, names, Limits(min_nodes=8, max_nodes=8))
    formed = agreed_round(nodes, lambda r: r.number == 0)

    assert sorted(formed.members) == names
    assert formed.world_size == 8
    assert sum(len(node.proposed) for node in nodes) == 1  # exactly one proposer won
    registry = RunRegistry(etcd_kv, run_id)
    registered = registry.nodes()
    arrival = sorted(registered.values(), key=lambda n: (n.joined_revision, n.node_id))
    assert formed.members == tuple(n.node_id for n in arrival)
    stored = registry.current_round()
    # The token is the round key's revision.
    assert stored is not None and stored.token == formed.token


@pytest.mark.slow
def test_expired_lease_gives_a_next_round_of_survivors_in_their_order(
    start: Starter, run_id: str
) -> None:
    nodes = start(run_id, [f"node-{i}" for i in range(8)], Limits(min_nodes=6, max_nodes=8),
                  ttl=timedelta(seconds=2))
    first = agreed_round(nodes, lambda r: r.number == 0)
    victim = next(n for n in nodes if n.node_id == first.members[3])
    victim.crash()  # stops renewing; the key goes only when etcd expires the lease

    survivors = [n for n in nodes if n is not victim]
    second = agreed_round(survivors, lambda r: r.number == 1)
    assert second.members == tuple(m for m in first.members if m != victim.node_id)
    assert "lost" in second.reason and victim.node_id in second.reason
    assert second.token > first.token


def test_a_late_node_joins_the_next_round_up_to_max(start: Starter, run_id: str) -> None:
    limits = Limits(min_nodes=2, max_nodes=4, last_call=0.3)
    early = start(run_id, ["a", "b", "c"], limits)
    first = agreed_round(early, lambda r: len(r.members) == 3)

    late = start(run_id, ["d"], limits)
    grown = agreed_round(early + late, lambda r: "d" in r.members)
    assert grown.members == (*first.members, "d")  # the old ranks do not move
    assert grown.number == first.number + 1

    spare = start(run_id, ["e"], limits)[0]
    # The round is full: "e" waits as a spare, and everyone else stays in "grown".
    assert _eventually_waits(spare)
    assert all(node.current == grown for node in early + late)


def test_two_run_ids_on_one_etcd_never_see_each_other(
    start: Starter, etcd_kv: EtcdKV, run_id: str
) -> None:
    other_id = run_id + "-other"
    limits = Limits(min_nodes=3, max_nodes=4, last_call=10)
    ours = start(run_id, [f"n{i}" for i in range(4)], limits)
    theirs = start(other_id, [f"n{i}" for i in range(4)], limits)  # the same node names
    mine = agreed_round(ours, lambda r: r.number == 0)
    other = agreed_round(theirs, lambda r: r.number == 0)

    assert mine.token != other.token
    mine_nodes = RunRegistry(etcd_kv, run_id).nodes()
    other_nodes = RunRegistry(etcd_kv, other_id).nodes()
    assert mine_nodes.keys() == other_nodes.keys()  # same names, separate keys
    assert {n.lease for n in mine_nodes.values()}.isdisjoint(n.lease for n in other_nodes.values())
    theirs[0].stop()  # a graceful leave in one run ...
    agreed_round(theirs[1:], lambda r: r.number == 1, timeout=10)
    assert all(node.current == mine for node in ours)  # ... leaves the other run alone


def _eventually_waits(node: SimulatedNode, timeout: float = 10) -> bool:
    with contextlib.suppress(WaitTimeout):
        return wait_until(lambda: isinstance(node.last_action, Wait), timeout,
                          "the node to wait", interval=0.05)
    return False


def test_the_first_round_forms_across_an_etcd_restart(fresh_etcd: EtcdServer, run_id: str
                                                      ) -> None:
    # Every watch breaks with the restart: each node reads the run again and watches on,
    # so the leader still hears the third registration, made after the restart.
    limits = Limits(min_nodes=3, max_nodes=3)
    early = start_nodes(fresh_etcd.endpoint, run_id, ["a", "b"], limits)
    late: list[SimulatedNode] = []
    try:
        wait_until(lambda: len(_registered(fresh_etcd, run_id)) == 2, 10, "a and b registered")
        fresh_etcd.restart()
        late = start_nodes(fresh_etcd.endpoint, run_id, ["c"], limits)
        formed = agreed_round(early + late, lambda r: r.number == 0, timeout=20)
        assert sorted(formed.members[:2]) == ["a", "b"] and formed.members[2] == "c"
        assert sum(len(node.proposed) for node in early + late) == 1
    finally:
        stop_nodes(early + late)


def test_below_min_the_round_pauses_everywhere_and_resumes_with_survivors_first(
    start: Starter, run_id: str
) -> None:
    limits = Limits(min_nodes=3, max_nodes=4, last_call=0.3)
    nodes = start(run_id, ["a", "b", "c"], limits)
    first = agreed_round(nodes, lambda r: r.number == 0)
    leader = next(n for n in nodes if n.watch.is_leader)
    survivors = [n for n in nodes if n is not leader]
    leader.stop()  # the leader leaves too: a follower takes over and pauses the round

    def paused(node: SimulatedNode) -> bool:
        action = node.last_action
        return (isinstance(action, Wait) and action.stop_workers and "paused" in action.reason
                and node.state.running is None)

    wait_until(lambda: all(paused(n) for n in survivors), 10, "every survivor to pause")
    late = start(run_id, ["d"], limits)
    resumed = agreed_round(survivors + late, lambda r: "d" in r.members)
    kept = tuple(m for m in first.members if m != leader.node_id)
    assert resumed.members == (*kept, "d")  # survivors keep their relative ranks
    assert resumed.reason == "resumed with 3 nodes"


def test_a_closed_run_reaches_the_followers_through_their_one_watch(
    start: Starter, etcd_kv: EtcdKV, run_id: str
) -> None:
    nodes = start(run_id, ["a", "b", "c"], Limits(min_nodes=3, max_nodes=3),
                  member_poll=30.0)  # no periodic re-read: only the watch can wake them
    agreed_round(nodes, lambda r: r.number == 0)
    assert sum(node.watch.is_leader for node in nodes) == 1
    RunRegistry(etcd_kv, run_id).close("failed: a user error")
    wait_until(lambda: all(isinstance(n.last_action, Closed) for n in nodes), 10,
               "every node to see the run closed")


def _registered(etcd: EtcdServer, run_id: str) -> dict[str, object]:
    kv = EtcdKV(etcd.endpoint)
    try:
        return dict(RunRegistry(kv, run_id).nodes())
    finally:
        kv.close()


def test_a_node_leaving_at_a_boundary_is_neither_lost_nor_admitted_again(
    start: Starter, etcd_kv: EtcdKV, run_id: str
) -> None:
    """The leaver writes the round without it and drops its registration in one
    transaction: the leader (a or b) proposes nothing after it, and a leave written
    against a round that was replaced first changes nothing."""
    registry = RunRegistry(etcd_kv, run_id)
    lease = etcd_kv.grant_lease(30)  # c's, as its agent would hold it
    registry.register(NodeInfo(node_id="c", host="127.0.0.1", nproc=1), lease)
    nodes = start(run_id, ["a", "b"], Limits(min_nodes=2, max_nodes=3, last_call=0.2))
    first = agreed_round(nodes, lambda r: "c" in r.members)
    registry.announce_leaving("c", {"source": "SIGTERM"}, lease)

    stale = dataclasses.replace(first, token=first.token - 1)
    assert registry.leave(without(stale, "c", "left c", 0, LIMITS_2_3), "c") is None
    assert registry.node("c") is not None and registry.current_round() == first

    written = registry.leave(without(first, "c", "left c after step 7 (SIGTERM)", 0, LIMITS_2_3),
                             "c")
    assert written is not None and written.members == tuple(m for m in first.members if m != "c")
    assert registry.node("c") is None
    assert etcd_kv.get(registry.key("leaving/c")) is None
    etcd_kv.revoke_lease(lease)
    agreed_round(nodes, lambda r: r.number == written.number)
    with pytest.raises(WaitTimeout):  # nobody calls c lost, or admits it again
        wait_until(lambda: any(n.rounds[-1].number > written.number for n in nodes), 1.0,
                   "a round after the leave")
    current = registry.current_round()
    assert current is not None and current.reason == "left c after step 7 (SIGTERM)"
