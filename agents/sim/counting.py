"""Every store call a simulated node makes, counted by method name: the benchmark's
"etcd operations per node per round" (target: at most 3, DESIGN section 6).

:class:`CountingKV` wraps any :class:`~elastic_rt.rendezvous.kv.KVStore` (the simulated
nodes' blocking clients); :class:`~agents.sim.etcd_aio.AioEtcdKV` counts its own calls
under the same names, so the swarm's figures and the threaded nodes' compare directly.
Watch events are pushed by etcd, so they are counted apart (``watch_event``) and left
out of :meth:`OpCounter.total`.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Iterable, Sequence

from elastic_rt.rendezvous.kv import Change, KeyValue, KVStore, TxnOp, TxnResult


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

    def txn(self, expect: dict[str, int], success: Sequence[TxnOp],
            failure: Sequence[TxnOp] = ()) -> TxnResult:
        self.counter.add("txn")
        return self.inner.txn(expect, success, failure)

    def delete(self, key: str) -> bool:
        self.counter.add("delete")
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self.counter.add("delete_prefix")
        self.inner.delete_prefix(prefix)

    def grant_lease(self, ttl_seconds: int) -> int:
        self.counter.add("grant_lease")
        return self.inner.grant_lease(ttl_seconds)

    def refresh_lease(self, lease_id: int, *, timeout: float | None = None) -> bool:
        self.counter.add("refresh_lease")
        return self.inner.refresh_lease(lease_id, timeout=timeout)

    def refresh_leases(self, lease_ids: Sequence[int]) -> list[bool]:
        """Counted per lease as ``refresh_lease``: each is a keep-alive etcd handles."""
        for _ in lease_ids:
            self.counter.add("refresh_lease")
        return self.inner.refresh_leases(lease_ids)

    def revoke_lease(self, lease_id: int) -> None:
        self.counter.add("revoke_lease")
        self.inner.revoke_lease(lease_id)

    def on_change(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        self.counter.add("watch")

        def counted() -> None:
            self.counter.add("watch_event")
            callback()

        return self.inner.on_change(prefix, counted)

    def watch_changes(self, prefix: str, callback: Callable[[list[Change] | None], None], *,
                      start_revision: int) -> Callable[[], None]:
        self.counter.add("watch")

        def counted(changes: list[Change] | None) -> None:
            self.counter.add("watch_event")
            callback(changes)

        return self.inner.watch_changes(prefix, counted, start_revision=start_revision)

    def close(self) -> None:
        self.inner.close()
