"""Helpers shared by tests and benchmarks: a fake clock, an operation-counting store,
and rendezvous participants without workers.

:class:`SimulatedNode` runs the agent's rendezvous loop (snapshot, decide, propose
or wait, woken by a watch on the run's prefix) on a thread, with a real
:class:`~elastic_rt.rendezvous.lease.LeaseKeeper`, and records every round it took
part in. Dozens of them fit in one process, which is how the integration tests and
``scripts/bench/rendezvous.py`` put many nodes on one etcd.

Note: the loop mirrors ``agents.agent.Agent._loop`` rather than importing it,
because the library never imports ``agents`` and a simulated node has no workers.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

from elastic_rt.config import DEFAULT_LEASE_TTL
from elastic_rt.errors import StoreError
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import KeyValue, KVStore
from elastic_rt.rendezvous.lease import LeaseKeeper
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import (
    Action,
    Closed,
    Limits,
    NodeInfo,
    Participate,
    Propose,
    Round,
    Wait,
    decide,
)

logger = logging.getLogger(__name__)


class FakeClock:
    """A clock that moves only when told, for the ``now`` of pure decisions."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now

    @property
    def now_ms(self) -> int:
        return int(self.now * 1000)


class OpCounter:
    """Thread-safe counts of store calls by method name, shared by many clients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def total(self, exclude: Iterable[str] = ("watch_event",)) -> int:
        """Calls sent to the store; watch events are pushed by it, so not counted."""
        skip = set(exclude)
        return sum(n for name, n in self.snapshot().items() if name not in skip)


class CountingKV:
    """A :class:`KVStore` that counts every call it passes on to ``inner``.

    Watch events delivered to ``on_change`` callbacks count as ``watch_event``.
    """

    def __init__(self, inner: KVStore, counter: OpCounter | None = None) -> None:
        self.inner = inner
        self.counter = counter or OpCounter()

    def get(self, key: str) -> KeyValue | None:
        self.counter.add("get")
        return self.inner.get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        self.counter.add("get_prefix")
        return self.inner.get_prefix(prefix)

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        self.counter.add("put")
        return self.inner.put(key, value, lease=lease)

    def put_if(
        self, key: str, value: bytes, *, expect: dict[str, int], lease: int | None = None
    ) -> int | None:
        self.counter.add("put_if")
        return self.inner.put_if(key, value, expect=expect, lease=lease)

    def delete(self, key: str) -> bool:
        self.counter.add("delete")
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self.counter.add("delete_prefix")
        self.inner.delete_prefix(prefix)

    def grant_lease(self, ttl_seconds: int) -> int:
        self.counter.add("grant_lease")
        return self.inner.grant_lease(ttl_seconds)

    def refresh_lease(self, lease_id: int) -> bool:
        self.counter.add("refresh_lease")
        return self.inner.refresh_lease(lease_id)

    def revoke_lease(self, lease_id: int) -> None:
        self.counter.add("revoke_lease")
        self.inner.revoke_lease(lease_id)

    def on_change(self, prefix: str, callback: Callable[[], None], *,
                  deletes_only: bool = False) -> Callable[[], None]:
        self.counter.add("watch")

        def counted() -> None:
            self.counter.add("watch_event")
            callback()

        return self.inner.on_change(prefix, counted, deletes_only=deletes_only)

    def close(self) -> None:
        self.inner.close()


class SimulatedNode:
    """One rendezvous participant on a thread: registration, lease, decisions, no workers.

    Args:
        kv: this node's store client (give each node its own, as real nodes have).
        run_id: the run to join.
        node_id: unique within the run.
        limits: ``--nnodes MIN:MAX`` and the last-call window.
        ttl: lease time-to-live.
        nproc: workers this node would run (only recorded in the round).
        wait_poll: seconds between snapshots while waiting (the agent's 0.5 s).
        member_poll: seconds between snapshots while in a round (the agent's
            monitor interval).
        watch: wake on writes as well as polling, as the agent does.
        wake_on: which keys' writes wake the node, relative to the run's prefix:
            ``""`` (every key, the agent's choice) or ``"round"`` (round changes only).
    """

    def __init__(
        self,
        kv: KVStore,
        run_id: str,
        node_id: str,
        limits: Limits,
        *,
        ttl: timedelta = DEFAULT_LEASE_TTL,
        nproc: int = 1,
        wait_poll: float = 0.5,
        member_poll: float = 0.1,
        watch: bool = True,
        wake_on: str = "",
    ) -> None:
        self.kv = kv
        self.registry = RunRegistry(kv, run_id)
        self.info = NodeInfo(node_id=node_id, host="127.0.0.1", nproc=nproc)
        self.node_id = node_id
        self.limits = limits
        self.keeper = LeaseKeeper(self.registry, self.info, ttl, on_fenced=self._on_fenced)
        self.wait_poll = wait_poll
        self.member_poll = member_poll
        self.watch = watch
        self.wake_on = wake_on
        self.rounds: list[Round] = []
        """Every round this node took part in, in order (one entry per round number)."""
        self.proposed: list[Round] = []
        """Rounds this node wrote (it won the compare)."""
        self.last_action: Action | None = None
        self.error: BaseException | None = None
        self.fenced: list[str] = []
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sim-{node_id}", daemon=True)

    # lifecycle ---------------------------------------------------------------------
    def start(self) -> "SimulatedNode":
        """Register and loop on the node's thread; returns at once."""
        self._thread.start()
        return self

    def halt(self) -> None:
        """Stop deciding (the lease is still kept): lets many nodes quiet down at once."""
        self._stop.set()
        self._wake.set()

    def stop(self, *, revoke: bool = True) -> None:
        """Leave: with ``revoke`` the registration goes now, else when the lease expires."""
        self.halt()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.keeper.stop(revoke=revoke)

    def crash(self) -> None:
        """Die silently: no more renewals and no revoke, so the lease runs out."""
        self.stop(revoke=False)

    # observation -------------------------------------------------------------------
    @property
    def current(self) -> Round | None:
        with self._changed:
            return self.rounds[-1] if self.rounds else None

    def wait_for_round(self, predicate: Callable[[Round], bool], timeout: float) -> Round:
        """Block until this node took part in a round that satisfies ``predicate``.

        Raises:
            TimeoutError: no such round within ``timeout`` seconds (or the loop died).
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for round_ in reversed(self.rounds):
                    if predicate(round_):
                        return round_
                left = deadline - time.monotonic()
                if left <= 0 or self.error is not None:
                    raise TimeoutError(
                        f"{self.node_id}: no matching round within {timeout:.1f} s; "
                        f"saw {[(r.number, r.members) for r in self.rounds]}, "
                        f"last action {self.last_action}, error {self.error!r}"
                    )
                self._changed.wait(min(left, 0.5))

    # the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        cancel_watch: Callable[[], None] | None = None
        try:
            self.keeper.start()
            if self.watch:
                cancel_watch = self.kv.on_change(self.registry.key(self.wake_on), self._wake.set)
            quorum_since: float | None = None
            while not self._stop.is_set():
                quorum_since = self._step(quorum_since)
        except BaseException as exc:  # noqa: BLE001 - thread boundary: keep it for the test
            logger.exception("simulated node %s died", self.node_id)
            with self._changed:
                self.error = exc
                self._changed.notify_all()
        finally:
            if cancel_watch is not None:
                cancel_watch()

    def _step(self, quorum_since: float | None) -> float | None:
        try:
            snapshot = self.registry.snapshot()
        except StoreError as exc:
            logger.debug("%s: snapshot failed: %s", self.node_id, exc)
            self._sleep(self.wait_poll)
            return quorum_since
        action = decide(
            snapshot,
            self.node_id,
            self.limits,
            now=time.monotonic(),
            quorum_since=quorum_since,
            now_ms=int(time.time() * 1000),
        )
        self.last_action = action
        if isinstance(action, Propose):
            self._propose(action)
            return quorum_since
        if isinstance(action, Participate):
            self._record(action.round)
            self._sleep(self.member_poll)
            return quorum_since
        if isinstance(action, Closed):
            self._stop.set()
            return quorum_since
        assert isinstance(action, Wait)
        self._sleep(self.wait_poll)
        return action.quorum_since

    def _propose(self, action: Propose) -> None:
        try:
            written = self.registry.propose(action)
        except StoreError as exc:
            logger.debug("%s: proposal failed: %s", self.node_id, exc)
            return
        if written is not None:
            with self._changed:
                self.proposed.append(written)

    def _record(self, round_: Round) -> None:
        with self._changed:
            if not self.rounds or self.rounds[-1].number != round_.number:
                self.rounds.append(round_)
                self._changed.notify_all()

    def _on_fenced(self, why: str) -> None:
        self.fenced.append(why)
        self._wake.set()

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()


@dataclass(frozen=True)
class FormResult:
    """How one round formed: wall time, store calls, and what every node agreed on."""

    n_nodes: int
    seconds: float
    ops: dict[str, int]
    rounds: dict[str, Round]
    """Each node's first round."""

    @property
    def total_ops(self) -> int:
        return sum(n for name, n in self.ops.items() if name != "watch_event")


def start_nodes(
    endpoint: str,
    run_id: str,
    names: Iterable[str],
    limits: Limits,
    *,
    counter: OpCounter | None = None,
    **node_kwargs: object,
) -> list[SimulatedNode]:
    """Build one client per node (counted when ``counter`` is given) and start them."""
    nodes = []
    for name in names:
        kv: KVStore = EtcdKV(endpoint)
        if counter is not None:
            kv = CountingKV(kv, counter)
        node = SimulatedNode(kv, run_id, name, limits, **node_kwargs)  # type: ignore[arg-type]
        nodes.append(node)
    for node in nodes:
        node.start()
    return nodes


def stop_nodes(nodes: Iterable[SimulatedNode], *, revoke: bool = True) -> None:
    """Halt every loop first, so one node's leave does not wake all the others."""
    nodes = list(nodes)
    for node in nodes:
        node.halt()
    for node in nodes:
        node.stop(revoke=revoke)
        node.kv.close()


def form_round(
    endpoint: str,
    run_id: str,
    n_nodes: int,
    *,
    ttl: timedelta = timedelta(seconds=10),
    timeout: float = 60.0,
    **node_kwargs: object,
) -> FormResult:
    """Start ``n_nodes`` nodes with ``--nnodes n:n`` and time until all are in round 0.

    Clients are connected before the clock starts (a real node connects before it
    joins); the time covers registration, the proposal and every node seeing it.
    Operations are counted over the same window.

    Raises:
        TimeoutError: the round did not form within ``timeout``.
    """
    limits = Limits(min_nodes=n_nodes, max_nodes=n_nodes)
    counter = OpCounter()
    clients = [CountingKV(EtcdKV(endpoint), counter) for _ in range(n_nodes)]
    nodes = [
        SimulatedNode(
            kv, run_id, f"node-{i:03d}", limits, ttl=ttl, **node_kwargs  # type: ignore[arg-type]
        )
        for i, kv in enumerate(clients)
    ]
    counter.reset()
    began = time.monotonic()
    try:
        for node in nodes:
            node.start()
        deadline = began + timeout
        rounds = {
            node.node_id: node.wait_for_round(
                lambda r: r.number == 0, max(0.0, deadline - time.monotonic())
            )
            for node in nodes
        }
        seconds = time.monotonic() - began
        ops = counter.snapshot()
    finally:
        stop_nodes(nodes)
    return FormResult(n_nodes=n_nodes, seconds=seconds, ops=ops, rounds=rounds)
