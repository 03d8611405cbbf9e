"""The elected rendezvous on a real etcd, through the swarm simulator (agents/sim/swarm*.py).

The swarm's nodes follow the run through the agent's own RunWatch (agents/run_watch.py),
spread over slice processes (agents/sim/swarm_slice.py) whose counts and rounds are merged.

Many coroutine nodes share a few etcd clients but each has its own lease, key and
watch, and runs the agent's decisions. These check the protocol's guarantees (one
writer per round, ranks stable for survivors, a new leader when the leader dies)
and its cost (about three etcd calls per node to form a round, none per follower
for the next ones). Timing figures are the benchmark's (scripts/bench/rendezvous.py).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Callable

import pytest

from agents.sim.swarm import Swarm, SwarmNode
from agents.sim.swarm_run import run_swarm
from elastic_rt.etcd_server import EtcdServer
from elastic_rt.rendezvous.rounds import Limits, Round

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def test_elected_swarm_forms_loses_and_grows_with_flat_cost(etcd_server: EtcdServer) -> None:
    report = run_swarm(etcd_server.endpoint, 24, processes=2, timeout=30, settle=0.5)
    form, lose, grow = report.phases
    assert form.round is not None and len(form.round.members) == 24
    assert form.ops.get("put_if") == 1 and not form.retries  # one writer, no race
    assert form.per_node() <= 3 + 1 / 24 + 1e-9  # lease, join, watch; +1 round write
    assert lose.round is not None and grow.round is not None
    survivors = [m for m in form.round.members if m in lose.round.members]
    assert list(lose.round.members) == survivors  # survivors keep their order
    assert lose.round.members == grow.round.members[:-1] and grow.round.members[-1] == "node-new"
    assert lose.per_node() < 0.5 and grow.per_node() < 0.5  # followers read nothing


def test_a_new_leader_takes_over_when_the_leader_dies(etcd_server: EtcdServer) -> None:
    asyncio.run(asyncio.wait_for(_leader_dies(etcd_server.endpoint), 60))


async def _leader_dies(endpoint: str) -> None:
    swarm = Swarm(endpoint, f"swarm-{uuid.uuid4().hex[:8]}", clients=2)
    limits = Limits(min_nodes=3, max_nodes=6, last_call=30.0)
    nodes = [SwarmNode(swarm, f"n{i}", limits) for i in range(6)]
    try:
        for node in nodes:
            node.start()
        first = await _agreed(nodes, lambda r: r.number == 0)
        leader = next(n for n in nodes if n.watch.is_leader)
        rest = [n for n in nodes if n is not leader]
        await leader.stop(revoke=True)  # the leader key goes with its lease
        second = await _agreed(rest, lambda r: leader.node_id not in r.members)
        assert list(second.members) == [m for m in first.members if m != leader.node_id]
        assert second.token > first.token
        assert sum(1 for n in rest if n.watch.is_leader) == 1
    finally:
        await asyncio.gather(*(node.stop() for node in nodes))
        await swarm.close()


async def _agreed(nodes: list[SwarmNode], predicate: Callable[[Round], bool]) -> Round:
    held = await asyncio.wait_for(
        asyncio.gather(*(n.wait_for_round(predicate) for n in nodes)), 20)
    assert len({(r.number, r.members, r.token) for r in held}) == 1, held
    return held[0]
