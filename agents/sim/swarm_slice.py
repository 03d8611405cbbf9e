"""One process's share of a swarm: a slice of the nodes, driven over a pipe.

No one process may be what the nodes wait on: one Python process holds one core,
under one GIL, and a thousand nodes in one were its limit, not etcd's. So
:func:`agents.sim.swarm_run.run_swarm` spreads the nodes over a few processes (2 by
default; at 1024 nodes the busiest used 0.20-0.29 cores over its life,
docs/rendezvous.md), each with its own event loop and channels, and each runs
:func:`serve` here. Every node is still a :class:`~agents.sim.swarm.SwarmNode` with its
own lease, key and watch, running the agent's decisions.

The parent drives the slices in lock step, one phase at a time: :class:`Arm` (each
slice gets ready to watch its nodes for the wanted round), then ``"go"`` to all at
once (the slice that holds the event's node acts on it), then each slice answers with
a :class:`SliceResult`. Times are ``time.monotonic()``, one clock for every process
on a Linux host, so the parent compares them directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from agents.sim.swarm import HarnessLoad, RoundTally, Swarm, SwarmNode
from elastic_rt.rendezvous.rounds import Limits, Round

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SliceSpec:
    """What a slice process needs to build its nodes (sent pickled at spawn)."""

    index: int
    """Which slice this is (:attr:`Arm.slice` names it)."""
    endpoint: str
    run_id: str
    node_ids: tuple[str, ...]
    limits: Limits
    clients: int
    ttl: timedelta = timedelta(seconds=10)
    member_poll: float = 1.0
    wait_poll: float = 0.5


@dataclass(frozen=True)
class Wanted:
    """The round a phase waits for, as data (a lambda does not cross a pipe)."""

    after: int = -1
    """Its number is greater than this."""
    without: str = ""
    """This node is not a member."""
    including: str = ""
    """This node is a member."""

    def __call__(self, round_: Round) -> bool:
        return (round_.number > self.after
                and (not self.without or self.without not in round_.members)
                and (not self.including or self.including in round_.members))


@dataclass(frozen=True)
class Arm:
    """Get ready for one phase; act on ``go``.

    ``event``: ``"start"`` (every node of every slice starts), ``"stop"`` (the slice
    holding ``node_id`` revokes its lease, as an agent evicts a dead peer) or
    ``"add"`` (slice number ``slice`` starts a new node ``node_id``).
    """

    event: str
    wanted: Wanted
    timeout: float
    node_id: str = ""
    slice: int = 0


@dataclass
class SliceResult:
    """A slice's answer to a phase: when its last node held the round, at what cost."""

    done_at: float
    rounds: set[Round]
    """The rounds its nodes held: one, if they agree."""
    ops: dict[str, int]
    retries: dict[str, int]
    joined_at: float = 0.0
    """When its last node had joined (registered and watching); 0 if none started."""
    proposed_at: list[float] = field(default_factory=list)
    missing: int = 0
    """Nodes that did not hold the round before the timeout."""
    cpu_seconds: float = 0.0
    """CPU the slice process used from ``go`` to this answer."""


def serve(conn: Connection, spec: SliceSpec) -> None:
    """The slice process's entry point: answer the parent's commands until ``close``."""
    logging.basicConfig(level=logging.ERROR)
    try:
        asyncio.run(_Slice(conn, spec).serve())
    except BaseException:  # noqa: BLE001 - process boundary: the parent reports it
        conn.send(("error", traceback.format_exc()))
        raise


class _Slice:
    def __init__(self, conn: Connection, spec: SliceSpec) -> None:
        self.conn = conn
        self.spec = spec

    async def _recv(self) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self.conn.recv)

    def _node(self, swarm: Swarm, node_id: str) -> SwarmNode:
        spec = self.spec
        return SwarmNode(swarm, node_id, spec.limits, ttl=spec.ttl,
                         member_poll=spec.member_poll, wait_poll=spec.wait_poll)

    async def serve(self) -> None:
        spec = self.spec
        swarm = Swarm(spec.endpoint, spec.run_id, clients=spec.clients)
        nodes = [self._node(swarm, node_id) for node_id in spec.node_ids]
        stop = asyncio.Event()
        monitor = asyncio.create_task(swarm.monitor(stop))
        keeper = asyncio.create_task(
            swarm.keep_alive(stop, max(0.2, spec.ttl.total_seconds() / 4)))
        try:
            # Connect every channel before the clock starts, as an agent's has at its
            # first rendezvous call (its preview read); not counted below.
            await asyncio.gather(*(swarm.call(kv.get(swarm.run_id)) for kv in swarm.clients))
            self.conn.send(("ready", None))
            while True:
                command = await self._recv()
                if command == "close":
                    break
                if isinstance(command, Arm):
                    nodes = await self._phase(swarm, nodes, command)
                elif command[0] == "keepalives":
                    swarm.counter.reset()
                    await asyncio.sleep(command[1])
                    self.conn.send(("keepalives", swarm.counter.snapshot().get("refresh_lease", 0)))
            stop.set()
            await asyncio.gather(monitor, keeper)
            self.conn.send(("closed", swarm.load))  # final now; leaving may take a while
        finally:
            stop.set()
            await asyncio.gather(monitor, keeper)
            await self._leave(swarm, nodes)

    async def _leave(self, swarm: Swarm, nodes: list[SwarmNode]) -> None:
        """Stop every node and revoke its lease, so its keys go now and not at a TTL
        in the middle of the next run; bounded, since a late revoke only costs that."""
        try:
            await asyncio.wait_for(
                asyncio.gather(*(node.stop(cancel_watch=False) for node in nodes)), 30)
        except asyncio.TimeoutError:
            logger.warning("swarm slice %d: leases not all revoked within 30 s; they end "
                           "at their TTL", self.spec.index)
        await swarm.close()

    async def _phase(self, swarm: Swarm, nodes: list[SwarmNode], arm: Arm) -> list[SwarmNode]:
        """One phase; returns the slice's nodes after it."""
        victim = next((n for n in nodes if arm.event == "stop" and n.node_id == arm.node_id),
                      None)
        nodes = [n for n in nodes if n is not victim]
        adding = arm.event == "add" and arm.slice == self.spec.index
        newcomer = self._node(swarm, arm.node_id) if adding else None
        if newcomer is not None:
            nodes.append(newcomer)
        swarm.counter.reset()
        swarm.retries.reset()
        self.conn.send(("armed", None))
        if await self._recv() != "go":
            raise RuntimeError("the parent sent no go")
        cpu = time.process_time()  # every thread of the process, to the nanosecond
        if arm.event == "start":
            for node in nodes:
                node.start()
        elif victim is not None:
            await victim.stop(revoke=True)
        elif newcomer is not None:
            newcomer.start()
        tally = swarm.tally = RoundTally(nodes, arm.wanted)
        try:
            await asyncio.wait_for(tally.done.wait(), arm.timeout)
        except asyncio.TimeoutError:
            pass
        swarm.tally = None
        started = [n.joined_at for n in nodes if n.joined_at]
        self.conn.send(("result", SliceResult(
            done_at=time.monotonic(),
            rounds=set(tally.held.values()),
            ops=swarm.counter.snapshot(), retries=swarm.retries.snapshot(),
            joined_at=max(started) if arm.event == "start" and started else 0.0,
            proposed_at=[t for n in nodes for t in n.proposed_at],
            missing=len(tally.pending), cpu_seconds=time.process_time() - cpu)))
        return nodes


def merge_loads(loads: list[HarnessLoad]) -> HarnessLoad:
    """One :class:`HarnessLoad` for all slices: samples pooled, CPU of the busiest.

    A slice is one process, so its CPU share is what can hit the GIL's one core;
    the total over slices is kept apart (:attr:`HarnessLoad.total_cpu`).
    """
    merged = HarnessLoad()
    for load in loads:
        merged.loop_lag += load.loop_lag
        merged.call_seconds += load.call_seconds
    busiest = max(loads, key=lambda load: load.cpu_share)
    merged.cpu_seconds, merged.wall_seconds = busiest.cpu_seconds, busiest.wall_seconds
    merged.total_cpu = sum(load.cpu_share for load in loads)
    merged.processes = len(loads)
    return merged
