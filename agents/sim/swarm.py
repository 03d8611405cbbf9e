"""Hundreds of rendezvous participants in one process: asyncio nodes over a few etcd channels.

:mod:`agents.sim.simulated` gives every node a thread, a lease-keeper thread and its own
gRPC channel; past ~200 nodes on two cores that harness, not etcd, is what is
measured. Here each node is a coroutine that runs the agent's own decisions
(:func:`agents.policy.decide` over the copy of the run that the agent's
:class:`agents.run_copy.RunCopy` holds), with its own lease, key, watch and
keep-alive. Its etcd calls are the agent's requests (the registry builds them) sent
by :class:`agents.sim.run_watch_aio.AioRunWatch` on one of a :class:`Swarm`'s ``clients``
asyncio channels (:class:`~agents.sim.etcd_aio.AioEtcdKV`), from the
event loop: no thread per call. A node's watch is armed on one of the shared
channels, as a real node arms it on its own.

A thousand nodes are several such swarms, one per process
(:mod:`agents.sim.swarm_slice`, driven by :func:`agents.sim.swarm_run.run_swarm`). The swarm
also measures itself (:class:`HarnessLoad`) so that a figure taken while
the harness was the bottleneck is never mistaken for etcd's or the protocol's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Awaitable, Callable, NoReturn, TypeVar

from agents import policy
from agents.inbox import Inbox
from agents.dispatch import Driver, carry_out_async
from agents.policy import Observation
from agents.sim.counting import OpCounter
from agents.sim.etcd_aio import AioEtcdKV
from agents.sim.run_watch_aio import AioRunWatch
from agents.sim.simulated import simulated_settings
from agents.sim.workerless import Workerless
from elastic_rt.errors import StoreError
from elastic_rt.rendezvous.registry import RunRequests
from elastic_rt.rendezvous.rounds import Limits, NodeInfo, Round

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class HarnessLoad:
    """How busy the harness itself was: the evidence that etcd, not it, set the pace."""

    loop_lag: list[float] = field(default_factory=list)
    """Seconds each 20 ms monitor tick came late: a busy event loop, whose nodes'
    answers from etcd wait that long before they are read."""
    call_seconds: list[float] = field(default_factory=list)
    """Seconds from each etcd call's send to its answer's being taken up by the node:
    etcd's pace plus gRPC's plus any loop lag."""
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    total_cpu: float = 0.0
    """Cores all the harness's processes used together over their life
    (agents/sim/swarm_slice.py)."""
    box_busy: float = 0.0
    """The largest share of the machine's cores that the harness and etcd kept busy
    together in one phase (agents/sim/swarm_run.py ``Phase.box_busy``)."""
    box_busy_phase: str = ""
    processes: int = 1

    @property
    def cpu_share(self) -> float:
        """Cores the busiest harness process used on average (1.0 = one core busy)."""
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds else 0.0

    def verdict(self, *, max_lag: float = 0.05, max_cpu: float = 0.9,
                max_box: float = 0.9) -> str | None:
        """Why the harness was the bottleneck, or None when it was not.

        Lag is judged at p90: a burst as a thousand nodes start at once is expected;
        a loop that is late on a tenth of its ticks is saturated (an answer from etcd
        waits that long to be read). A process above ``max_cpu`` cores is at its
        GIL's limit. When the harness and etcd together kept more than ``max_box``
        of the machine's cores busy in a phase, etcd shared the CPU with the harness
        and its pace may be the harness's, however idle each loop looked.
        """
        lag = _p(self.loop_lag, 0.9)
        problems = []
        if lag > max_lag:
            problems.append(f"event loop p90 lag {lag * 1000:.0f} ms > {max_lag * 1000:.0f} ms")
        if self.cpu_share > max_cpu:
            problems.append(f"a harness process used {self.cpu_share:.2f} cores (GIL-bound "
                            f"above {max_cpu})")
        if self.box_busy > max_box:
            problems.append(f"harness and etcd kept {self.box_busy:.0%} of the machine's "
                            f"cores busy in {self.box_busy_phase!r} (> {max_box:.0%}: etcd "
                            f"shared the CPU with the harness)")
        return "; ".join(problems) or None

    def summary(self) -> str:
        return (f"loop lag p90/p99 {_p(self.loop_lag, 0.9) * 1000:.0f}/"
                f"{_p(self.loop_lag, 0.99) * 1000:.0f} ms, call p50/p90 "
                f"{_p(self.call_seconds, 0.5) * 1000:.0f}/"
                f"{_p(self.call_seconds, 0.9) * 1000:.0f} ms, harness cpu "
                f"{self.cpu_share:.2f} (busiest of {self.processes} processes; "
                f"{self.total_cpu:.2f} in all), harness + etcd {self.box_busy:.0%} of the "
                f"machine in {self.box_busy_phase!r}")


def _p(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RoundTally:
    """Which of ``nodes`` hold a round that ``wanted`` accepts, kept as they take it.

    A phase waits for a thousand nodes at once; a task per node waiting on its own
    event cost the harness's loop a wake-up per node, on top of the node's own.
    """

    def __init__(self, nodes: list["SwarmNode"], wanted: Callable[[Round], bool]) -> None:
        self.wanted = wanted
        self.held: dict[str, Round] = {}
        """The first accepted round each node took."""
        self.pending = {node.node_id for node in nodes}
        self.done = asyncio.Event()
        for node in nodes:
            for round_ in node.rounds:
                self.saw(node.node_id, round_)
        if not self.pending:
            self.done.set()

    def saw(self, node_id: str, round_: Round) -> None:
        """``node_id`` took part in ``round_``."""
        if node_id in self.pending and self.wanted(round_):
            self.pending.discard(node_id)
            self.held[node_id] = round_
            if not self.pending:
                self.done.set()


class Swarm:
    """The shared channels and counters of many :class:`SwarmNode`.

    Use inside a running event loop; :meth:`close` releases the channels.
    """

    def __init__(self, endpoint: str, run_id: str, *, clients: int = 8) -> None:
        self.run_id = run_id
        self.requests = RunRequests(run_id)
        self.counter = OpCounter()
        self.retries = OpCounter()
        """Calls that etcd failed (``store_error``) and proposals that lost the compare."""
        self._clients = [AioEtcdKV(endpoint, self.counter) for _ in range(clients)]
        self._next = itertools.count()
        self.load = HarnessLoad()
        self.tally: RoundTally | None = None
        """Told of every round a node takes part in, while a phase waits for one."""
        self._leases: dict[int, Callable[[], Awaitable[None]]] = {}

    @property
    def clients(self) -> list[AioEtcdKV]:
        return list(self._clients)

    def kv(self) -> AioEtcdKV:
        """The next shared channel (round robin), as a node's own."""
        return self._clients[next(self._next) % len(self._clients)]

    async def call(self, call: Awaitable[T]) -> T:
        """Await one etcd call, recording how long its answer took to be taken up."""
        began = time.monotonic()
        try:
            return await call
        finally:
            self.load.call_seconds.append(time.monotonic() - began)

    async def monitor(self, stop: asyncio.Event, tick: float = 0.02) -> None:
        """Sample the event loop's lag and the process's CPU until ``stop`` is set."""
        began, cpu = time.monotonic(), time.process_time()
        while not stop.is_set():
            expected = time.monotonic() + tick
            await asyncio.sleep(tick)
            self.load.loop_lag.append(max(0.0, time.monotonic() - expected))
        self.load.wall_seconds = time.monotonic() - began
        self.load.cpu_seconds = time.process_time() - cpu
        self.load.total_cpu = self.load.cpu_share

    def keep(self, lease_id: int, on_lost: Callable[[], Awaitable[None]]) -> None:
        """Renew ``lease_id`` from now on; ``on_lost`` runs when etcd says it expired."""
        self._leases[lease_id] = on_lost

    def forget(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)

    async def keep_alive(self, stop: asyncio.Event, interval: float, batch: int = 128) -> None:
        """Renew every kept lease each ``interval`` (ttl/4, as ``LeaseKeeper``).

        Every node's lease gets its own keep-alive, as from its own agent, but up to
        ``batch`` of them share one stream: a call per lease would make the harness's
        Python, not etcd, the limit at a thousand nodes (measured: 0.9 cores).
        """
        while not stop.is_set():
            began = time.monotonic()
            ids = list(self._leases)
            chunks = [ids[i:i + batch] for i in range(0, len(ids), batch)]
            results = await asyncio.gather(
                *(self.call(self.kv().refresh_leases(chunk)) for chunk in chunks),
                return_exceptions=True)
            for chunk, alive in zip(chunks, results):
                if isinstance(alive, BaseException):
                    self.retries.add("store_error")
                    continue
                for lease_id, ok in zip(chunk, alive):
                    on_lost = self._leases.pop(lease_id, None)
                    if not ok and on_lost is not None:
                        self.retries.add("lease_lost")
                        try:
                            await on_lost()
                        except StoreError:  # it registers again at the next lost renewal
                            self.retries.add("store_error")
                    elif on_lost is not None:
                        self._leases[lease_id] = on_lost
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, interval - (time.monotonic() - began)))
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients),
                             return_exceptions=True)


class SwarmNode(Workerless):
    """One participant: own lease and key, the agent's decisions, shared channels.

    It follows the run as an agent does, with the agent's
    :class:`~agents.run_copy.RunCopy` and requests (one join transaction, then a
    watch: the leader's on the whole run, a follower's on the ``round`` keys),
    carried by :class:`~agents.sim.run_watch_aio.AioRunWatch` on the event loop.

    Args:
        swarm: where its etcd calls go.
        node_id: unique within the run.
        limits: ``--nnodes MIN:MAX`` and the last-call window.
        ttl: lease time-to-live; the swarm renews it every quarter of it (see
            :meth:`Swarm.keep_alive`), as ``LeaseKeeper`` does.
        member_poll: the agent's re-read period while in a round (``reread_every``).
    """

    def __init__(self, swarm: Swarm, node_id: str, limits: Limits, *,
                 ttl: timedelta = timedelta(seconds=10), member_poll: float = 1.0,
                 wait_poll: float = 0.5) -> None:
        self.swarm = swarm
        self.node_id = node_id
        self.info = NodeInfo(node_id=node_id, host="127.0.0.1", nproc=1)
        self.ttl = ttl
        self.settings = simulated_settings(node_id, limits, wait_poll=wait_poll,
                                           member_poll=member_poll)
        self.kv = swarm.kv()
        self.inbox = Inbox()
        self._wake = asyncio.Event()
        self.watch = AioRunWatch(swarm.requests, self.kv, self.inbox, on_change=self._wake.set)
        self.driver = Driver(self.settings)
        self.lease = 0
        self.rounds: list[Round] = []
        """Every round this node took part in, in order."""
        self.proposed: list[Round] = []
        self.joined_at = 0.0
        """Monotonic time the node's registration (and watch) was done."""
        self.proposed_at: list[float] = []
        """Monotonic time of each won proposal."""
        self._round_seen = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name=self.node_id))

    async def stop(self, *, revoke: bool = True, cancel_watch: bool = True) -> None:
        """Leave: with ``revoke`` the key goes now (a graceful leave or an eviction).

        ``cancel_watch=False`` when the shared channels close next (their streams end
        every watch at once).
        """
        self.swarm.forget(self.lease)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if cancel_watch:
            self.watch.close()
        if revoke and self.lease:
            try:
                await self.swarm.call(self.kv.revoke_lease(self.lease))
            except StoreError:
                logger.debug("%s: revoke failed", self.node_id, exc_info=True)

    async def wait_for_round(self, predicate: Callable[[Round], bool]) -> Round:
        while True:
            for round_ in reversed(self.rounds):
                if predicate(round_):
                    return round_
            self._round_seen.clear()
            await self._round_seen.wait()

    # the agent's loop ----------------------------------------------------------------
    async def _run(self) -> None:
        await self._register()
        self.joined_at = time.monotonic()
        while True:
            await self._step()

    async def _register(self) -> None:
        """A new lease, then the agent's join: one transaction and one watch."""
        self.lease = await self.swarm.call(self.kv.grant_lease(max(1, int(self.ttl.seconds))))
        await self.swarm.call(self.watch.join(self.info, self.lease))
        self.swarm.keep(self.lease, self._lease_lost)

    async def _step(self) -> None:
        if self.inbox.take_fenced():
            await carry_out_async(self, self.driver, policy.Fenced())
        snapshot, store_error = await self.watch.read(self.driver.state, self.settings)
        if store_error:
            self.swarm.retries.add("store_error")
        obs = Observation(now=time.monotonic(), now_ms=int(time.time() * 1000),
                          snapshot=snapshot, store_error=store_error)
        await carry_out_async(self, self.driver, obs)

    # the hands (agents.dispatch): the agent's, without workers, awaited -----------------
    async def propose(self, action: policy.ProposeRound) -> None:
        self.inbox.reread()
        try:
            written = await self.swarm.call(self.watch.propose(action.proposal))
        except StoreError:
            self.swarm.retries.add("store_error")
            return
        if written is None:
            self.swarm.retries.add("lost_proposal")
        else:
            self.proposed.append(written)
            self.proposed_at.append(time.monotonic())

    async def start_workers(self, action: policy.StartWorkers) -> policy.WorkersStarted:
        """Starting workers only records the round."""
        self._record(action.round)
        return policy.WorkersStarted(action.round)

    async def follow_round(self, action: policy.FollowRound) -> policy.RoundFollowed:
        self._record(action.round)
        return policy.RoundFollowed(action.round, now=time.monotonic())

    def _record(self, round_: Round) -> None:
        if not self.rounds or self.rounds[-1].number != round_.number:
            self.rounds.append(round_)
            self._round_seen.set()
            if self.swarm.tally is not None:
                self.swarm.tally.saw(self.node_id, round_)

    async def stop_workers(self, action: policy.StopWorkers) -> None:
        pass

    async def register(self, action: policy.Register) -> policy.Registered:
        return policy.Registered()  # _lease_lost registered the node again already

    async def sleep(self, action: policy.Sleep) -> None:
        # Until woken or the time is up; a timer that sets the same event costs
        # the loop less than wait_for's extra task, a thousand nodes at a time.
        timer = asyncio.get_running_loop().call_later(action.seconds, self._wake.set)
        await self._wake.wait()
        timer.cancel()
        self._wake.clear()

    def close_run(self, action: policy.CloseRun) -> NoReturn:
        self._unexpected(action)

    def exit(self, action: policy.Exit) -> NoReturn:
        self._unexpected(action)

    def join_timed_out(self, action: policy.JoinTimedOut) -> NoReturn:
        self._unexpected(action)

    def _unexpected(self, action: policy.Action) -> NoReturn:
        raise RuntimeError(f"{self.node_id}: unexpected {action} in a rendezvous swarm")

    async def _lease_lost(self) -> None:
        """The lease expired: the node is fenced and registers afresh, as an agent does."""
        self.inbox.fenced()
        await self._register()
