"""The rendezvous's etcd calls over ``grpc.aio``: many simulated nodes on one event loop.

No thread per call: a node's join costs the harness ~0.7 ms of CPU here (three gRPC
calls of ~150 us each in gRPC's core, the rest asyncio and the agent's decisions),
against ~4.6 ms through threads and python-etcd3, which starved etcd of the two
cores it shared with them (docs/rendezvous.md). The simulator's only: the product's
one etcd client is the blocking :class:`~elastic_rt.rendezvous.etcd_kv.EtcdKV` (one
node per process, one client). Here the same
requests (built by :func:`~elastic_rt.rendezvous.etcd_kv.txn_request` and the
registry's pure ``*_request`` methods) go out on etcd's own generated stubs over an
asyncio channel, and the answers come back on the caller's event loop: no thread,
no queue.

Watches share one bidirectional stream per client, as python-etcd3's do, but their
creations are pipelined: etcd answers the create requests of one stream in the order
they were sent (its server sends each ``created`` reply through one ordered control
channel, and holds a new watch's events until its reply is out), so the n-th reply
belongs to the n-th request. python-etcd3 instead waits for each reply before
sending the next create.

Plaintext to one endpoint, no auth or fail-over: it is for simulators on a local
etcd. Every call is counted in ``counter`` under the names
:class:`agents.sim.counting.CountingKV` uses, so a benchmark's calls per node are
the store's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from typing import Any, Callable, Sequence

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402
import grpc.aio  # noqa: E402
import etcd3.utils  # noqa: E402
from etcd3 import etcdrpc  # noqa: E402

from agents.sim.counting import OpCounter  # noqa: E402
from elastic_rt.errors import StoreConnectionError  # noqa: E402
from elastic_rt.rendezvous.etcd_messages import pb_kv, txn_request, txn_result  # noqa: E402
from elastic_rt.rendezvous.kv import (  # noqa: E402
    Change,
    KeyValue,
    PutIf,
    TxnRequest,
    TxnResult,
)

logger = logging.getLogger(__name__)

WatchCallback = Callable[[list[Change] | None], None]
_DELETE = etcdrpc.kv_pb2.Event.DELETE


class AioEtcdKV:
    """One channel to etcd, used from one event loop.

    Args:
        endpoint: ``host:port`` of a plaintext etcd.
        counter: where each call is counted (by the :class:`CountingKV` names).
        timeout: seconds for each unary call.
    """

    def __init__(self, endpoint: str, counter: OpCounter | None = None, *,
                 timeout: float = 5.0) -> None:
        self.endpoint = endpoint
        self.counter = counter or OpCounter()
        self._timeout = timeout
        self._channel = grpc.aio.insecure_channel(endpoint, options=[
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ])
        self._kv = etcdrpc.KVStub(self._channel)
        self._lease = etcdrpc.LeaseStub(self._channel)
        self._watch_stub = etcdrpc.WatchStub(self._channel)
        self._watches: _WatchStream | None = None

    async def _unary(self, what: str, call: Any) -> Any:
        self.counter.add(what)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise _translated(exc, what, self.endpoint) from exc

    async def get(self, key: str) -> KeyValue | None:
        response = await self._unary("get", self._kv.Range(
            etcdrpc.RangeRequest(key=key.encode()), timeout=self._timeout))
        return pb_kv(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        key = prefix.encode()
        response = await self._unary("get_prefix", self._kv.Range(etcdrpc.RangeRequest(
            key=key, range_end=etcd3.utils.prefix_range_end(key),
            sort_order=etcdrpc.RangeRequest.ASCEND), timeout=self._timeout))
        return [pb_kv(kv) for kv in response.kvs]

    async def txn(self, request: TxnRequest) -> TxnResult:
        response = await self._unary("txn", self._kv.Txn(
            txn_request(request.expect, request.success, request.failure),
            timeout=self._timeout))
        return txn_result(response)

    async def put_if(self, write: PutIf) -> int | None:
        """Write unless a compare fails (None); the new revision, read in the same
        transaction, as :meth:`EtcdKV.put_if` does."""
        request = txn_request(write.expect, [], [])
        request.success.add(request_put=etcdrpc.PutRequest(key=write.key.encode(),
                                                           value=write.value))
        request.success.add(request_range=etcdrpc.RangeRequest(key=write.key.encode()))
        response = await self._unary("put_if", self._kv.Txn(request, timeout=self._timeout))
        if not response.succeeded:
            return None
        return int(response.responses[1].response_range.kvs[0].mod_revision)

    async def grant_lease(self, ttl_seconds: int) -> int:
        response = await self._unary("grant_lease", self._lease.LeaseGrant(
            etcdrpc.LeaseGrantRequest(TTL=ttl_seconds), timeout=self._timeout))
        return int(response.ID)

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._unary("revoke_lease", self._lease.LeaseRevoke(
                etcdrpc.LeaseRevokeRequest(ID=lease_id), timeout=self._timeout))
        except StoreConnectionError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, grpc.aio.AioRpcError)
                    and cause.code() == grpc.StatusCode.NOT_FOUND):
                raise

    async def refresh_leases(self, lease_ids: Sequence[int]) -> list[bool]:
        """One keep-alive per lease over one stream; per lease, False once it expired."""
        for _ in lease_ids:
            self.counter.add("refresh_lease")
        requests = [etcdrpc.LeaseKeepAliveRequest(ID=lease_id) for lease_id in lease_ids]
        ttls: dict[int, int] = {}
        try:
            call = self._lease.LeaseKeepAlive(iter(requests), timeout=self._timeout)
            async for response in call:
                ttls[int(response.ID)] = int(response.TTL)
        except grpc.aio.AioRpcError as exc:
            raise _translated(exc, "refresh_leases", self.endpoint) from exc
        return [ttls.get(lease_id, 0) > 0 for lease_id in lease_ids]

    async def watch_changes(self, prefix: str, callback: WatchCallback, *,
                            start_revision: int) -> Callable[[], None]:
        """As :meth:`KVStore.watch_changes`, with ``callback`` run on the event loop.

        Returns the function that cancels the watch (it sends the cancel in the
        background).
        """
        self.counter.add("watch")

        def counted(changes: list[Change] | None) -> None:
            self.counter.add("watch_event")
            callback(changes)

        if self._watches is None or self._watches.broken:
            self._watches = _WatchStream(self._watch_stub.Watch(), self.endpoint)
        return await self._watches.add(prefix, counted, start_revision)

    async def close(self) -> None:
        if self._watches is not None:
            self._watches.close()
        await self._channel.close()


class _WatchStream:
    """One ``Watch`` stream and the callbacks of the watches on it, by watch id."""

    def __init__(self, call: Any, endpoint: str) -> None:
        self._call = call
        self._endpoint = endpoint
        self._write = asyncio.Lock()
        self._pending: collections.deque[tuple[WatchCallback, asyncio.Future[int]]] = \
            collections.deque()
        self._callbacks: dict[int, WatchCallback] = {}
        self.broken = False
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="etcd-watch")

    async def add(self, prefix: str, callback: WatchCallback,
                  start_revision: int) -> Callable[[], None]:
        key = prefix.encode()
        end = etcd3.utils.prefix_range_end(key)
        created: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        # The lock keeps the order of the queue that of the writes (see the module).
        async with self._write:
            if self.broken:
                raise StoreConnectionError(f"etcd at {self._endpoint}: watch stream broke")
            self._pending.append((callback, created))
            try:
                await self._call.write(etcdrpc.WatchRequest(
                    create_request=etcdrpc.WatchCreateRequest(
                        key=key, range_end=end, start_revision=start_revision)))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                self._break()
                raise StoreConnectionError(
                    f"etcd at {self._endpoint} failed on watch {prefix}: {exc}") from exc
        watch_id = await created

        def cancel() -> None:
            if self._callbacks.pop(watch_id, None) is not None and not self.broken:
                asyncio.get_running_loop().create_task(self._cancel(watch_id))

        return cancel

    async def _cancel(self, watch_id: int) -> None:
        try:
            async with self._write:
                await self._call.write(etcdrpc.WatchRequest(
                    cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            logger.debug("cancelling watch %d failed", watch_id, exc_info=True)

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                if response.created and self._pending:
                    callback, created = self._pending.popleft()
                    self._callbacks[int(response.watch_id)] = callback
                    created.set_result(int(response.watch_id))
                callback_ = self._callbacks.get(int(response.watch_id))
                if callback_ is None:
                    continue
                if response.canceled:  # compacted, or refused: the reader must re-read
                    del self._callbacks[int(response.watch_id)]
                    callback_(None)
                elif response.events:
                    callback_([Change(pb_kv(event.kv), event.type == _DELETE)
                               for event in response.events])
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - the stream's end: its watchers re-read
            logger.debug("watch stream to %s broke", self._endpoint, exc_info=True)
        self._break()

    def _break(self) -> None:
        """Every watch on the stream hears None once (read afresh, watch again)."""
        if self.broken:
            return
        self.broken = True
        while self._pending:
            _callback, created = self._pending.popleft()
            if not created.done():
                created.set_exception(StoreConnectionError(
                    f"etcd at {self._endpoint}: watch stream broke"))
        callbacks, self._callbacks = self._callbacks, {}
        for callback in callbacks.values():
            callback(None)

    def close(self) -> None:
        self.broken = True
        self._reader.cancel()
        self._call.cancel()


def _translated(exc: grpc.aio.AioRpcError, what: str, endpoint: str) -> StoreConnectionError:
    details = " ".join((exc.details() or "").split())[:200]
    return StoreConnectionError(f"etcd at {endpoint} failed on {what}: {exc.code().name} "
                                f"{details}")
