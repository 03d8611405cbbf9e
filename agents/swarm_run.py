"""Scenarios on a :class:`~agents.swarm.Swarm`: form a round, lose a node, admit one.

Each scenario times one event to "every node holds the new round" and counts what it
cost: etcd calls per node by kind (sent by the nodes), retries, and etcd's own
request count from its ``/metrics`` endpoint, which also sees calls our counters
might miss. A run raises :class:`HarnessBound` when the harness, not etcd, was the
bottleneck (see :meth:`agents.swarm.HarnessLoad.verdict`).
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from agents.swarm import HarnessLoad, Swarm, SwarmNode
from elastic_rt.rendezvous.rounds import Limits, Round

_HANDLED = re.compile(r'^grpc_server_handled_total\{.*grpc_method="(\w+)".*\} (\S+)$')


class HarnessBound(RuntimeError):
    """The harness (its event loop, threads or CPU) limited the figure, not etcd."""


def etcd_requests(endpoint: str) -> dict[str, float]:
    """gRPC calls etcd has answered so far, by method (Range, Txn, Put, LeaseGrant...)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        match = _HANDLED.match(line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0.0) + float(match.group(2))
    return counts


@dataclass
class Phase:
    """One event, timed until every node held the resulting round."""

    name: str
    n_nodes: int
    seconds: float
    ops: dict[str, int]
    retries: dict[str, int]
    etcd: dict[str, float]
    """etcd's answered calls in the window, by method."""
    round: Round | None = None
    began: float = 0.0
    """Monotonic time of the event."""
    milestones: dict[str, float] = field(default_factory=dict)
    """Seconds from the event to each step on the way (where the time went)."""

    def per_node(self, exclude: tuple[str, ...] = ("watch_event", "refresh_lease")) -> float:
        """etcd calls per node for this event; keep-alives are per second, not per
        round (:attr:`SwarmReport.lease_refresh_per_s`), and watch events are pushed."""
        return sum(n for k, n in self.ops.items() if k not in exclude) / self.n_nodes

    @property
    def etcd_rate(self) -> float:
        return sum(self.etcd.values()) / self.seconds if self.seconds else 0.0


@dataclass
class SwarmReport:
    phases: list[Phase] = field(default_factory=list)
    load: HarnessLoad = field(default_factory=HarnessLoad)
    lease_refresh_per_s: float = 0.0
    """Keep-alives sent per second while the round stood (item: lease load at N)."""

    def check(self) -> None:
        """Raise when the harness, not etcd, set the pace of these figures."""
        verdict = self.load.verdict()
        if verdict is not None:
            raise HarnessBound(f"the harness was the bottleneck: {verdict}")


async def _timed(name: str, swarm: Swarm, endpoint: str, nodes: list[SwarmNode],
                 predicate: Any, timeout: float, event: Any) -> Phase:
    swarm.counter.reset()
    swarm.retries.reset()
    before = etcd_requests(endpoint)
    began = time.monotonic()
    await event()
    try:
        held = await asyncio.wait_for(
            asyncio.gather(*(node.wait_for_round(predicate) for node in nodes)), timeout)
    except asyncio.TimeoutError:
        counts = {len(n.rounds) for n in nodes}
        raise TimeoutError(f"{name}: not every node held the round within {timeout:.0f} s "
                           f"(rounds seen per node: {counts})") from None
    seconds = time.monotonic() - began
    after = etcd_requests(endpoint)
    if len({(r.number, r.token) for r in held}) != 1:
        raise AssertionError(f"{name}: nodes disagree on the round")
    etcd = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    return Phase(name, len(nodes), seconds, swarm.counter.snapshot(), swarm.retries.snapshot(),
                 etcd, held[0], began)


async def run_swarm(endpoint: str, n_nodes: int, *,
                    events: bool = True, clients: int = 16, workers: int = 64,
                    timeout: float = 60.0, settle: float = 3.0, **node_kwargs: Any
                    ) -> SwarmReport:
    """Form a round of ``n_nodes``; with ``events``, then evict one node and admit one.

    The eviction is what an agent does when a peer's liveness socket refuses (it
    revokes the peer's lease), so the time measured is the protocol's, not a TTL.
    """
    run_id = f"swarm-{uuid.uuid4().hex[:8]}"
    swarm = Swarm(endpoint, run_id, clients=clients, workers=workers)
    limits = Limits(min_nodes=max(1, n_nodes - 1), max_nodes=n_nodes, last_call=60.0)
    nodes = [SwarmNode(swarm, f"node-{i:04d}", limits, **node_kwargs) for i in range(n_nodes)]
    report = SwarmReport(load=swarm.load)
    stop = asyncio.Event()
    monitor = asyncio.create_task(swarm.monitor(stop))
    ttl = node_kwargs.get("ttl", timedelta(seconds=10))
    keeper = asyncio.create_task(swarm.keep_alive(stop, max(0.2, ttl.total_seconds() / 4)))
    try:
        async def start_all() -> None:
            for node in nodes:
                node.start()

        formed = await _timed("form", swarm, endpoint, nodes, lambda r: True, timeout,
                              start_all)
        formed.milestones = {
            "all joined": max(n.joined_at for n in nodes) - formed.began,
            "round written": min(t for n in nodes for t in n.proposed_at) - formed.began}
        report.phases.append(formed)
        swarm.counter.reset()
        await asyncio.sleep(settle)
        report.lease_refresh_per_s = swarm.counter.snapshot().get("refresh_lease", 0) / settle
        if events:
            victim = nodes[n_nodes // 2]
            survivors = [node for node in nodes if node is not victim]
            before = formed.round
            assert before is not None
            report.phases.append(await _timed(
                "lose 1", swarm, endpoint, survivors,
                lambda r: r.number > before.number and victim.node_id not in r.members,
                timeout, lambda: victim.stop(revoke=True)))
            nodes = survivors
            newcomer = SwarmNode(swarm, "node-new", limits, **node_kwargs)
            nodes.append(newcomer)

            async def admit() -> None:
                newcomer.start()

            report.phases.append(await _timed(
                "grow 1", swarm, endpoint, nodes, lambda r: "node-new" in r.members, timeout,
                admit))
    finally:
        stop.set()
        await asyncio.gather(monitor, keeper)
        await asyncio.gather(*(node.stop() for node in nodes))
        swarm.close()
    return report
