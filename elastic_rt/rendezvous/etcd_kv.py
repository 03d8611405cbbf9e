"""The only importer of ``etcd3``: the KVStore protocol over the etcd v3 API.

Every etcd or gRPC failure is translated here, keeping the cause (``from exc``):
connection problems become :class:`StoreConnectionError` (retryable), refused
credentials become :class:`CredentialsError` (a user mistake).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Callable, TypeVar

# gRPC's core logs an INFO line at every fork (the agent forks workers); keep errors only.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import etcd3  # noqa: E402 - after the gRPC setting above
import etcd3.watch
import grpc  # noqa: E402
import six  # noqa: E402


from elastic_rt.config import EtcdAuth
from elastic_rt.errors import CredentialsError, StoreConnectionError
from elastic_rt.rendezvous.kv import KeyValue

logger = logging.getLogger(__name__)

# python3-etcd3 0.13's watch thread calls six.itervalues when a stream breaks but never
# imports six, so an etcd restart killed the thread with a NameError and every watch
# went silent. Supplying the module restores its own error path.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = six

T = TypeVar("T")
_AUTH_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


def _translated(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: "EtcdKV", *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in _AUTH_CODES:
                raise CredentialsError(
                    f"etcd at {self.endpoint} refused our credentials ({code.name})",  # type: ignore[union-attr]
                    "Check --etcd-user/--etcd-password or the client certificate.",
                ) from exc
            raise StoreConnectionError(
                f"The connection to etcd at {self.endpoint} failed. See inner exception for details."
            ) from exc
        except (etcd3.exceptions.Etcd3Exception, ValueError) as exc:
            raise StoreConnectionError(
                f"The connection to etcd at {self.endpoint} failed. See inner exception for details."
            ) from exc

    return wrapper


class EtcdKV:
    """KVStore on one etcd endpoint.

    Args:
        endpoint: ``host:port``.
        auth: TLS files and user/password; the password is only handed to the client.
        timeout: seconds for each unary call, so a dead etcd fails fast.
    """

    def __init__(self, endpoint: str, *, auth: EtcdAuth | None = None, timeout: float = 5.0) -> None:
        self.endpoint = endpoint
        host, _, port = endpoint.rpartition(":")
        auth = auth or EtcdAuth()
        try:
            self._client = etcd3.client(
                host=host,
                port=int(port),
                ca_cert=auth.cacert,
                cert_cert=auth.cert,
                cert_key=auth.key,
                user=auth.user,
                password=auth.password,
                timeout=timeout,
            )
        except grpc.RpcError as exc:
            raise CredentialsError(
                f"etcd at {endpoint} refused to authenticate user {auth.user!r}",
                "Check --etcd-user and --etcd-password.",
            ) from exc
        # The client benches an endpoint for 300 s after one failed call. With a single
        # endpoint that turns an etcd restart of a second into five minutes of errors,
        # so let gRPC reconnect on the next call instead.
        for node in self._client.endpoints.values():
            node.time_retry = 0

    @staticmethod
    def _kv(key: str, value: bytes, meta: Any) -> KeyValue:
        return KeyValue(
            key=key,
            value=value,
            mod_revision=int(meta.mod_revision),
            create_revision=int(meta.create_revision),
            lease=int(meta.lease_id),
        )

    @_translated
    def get(self, key: str) -> KeyValue | None:
        value, meta = self._client.get(key)
        if meta is None:
            return None
        return self._kv(key, value, meta)

    @_translated
    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [
            self._kv(meta.key.decode(), value, meta)
            for value, meta in self._client.get_prefix(prefix, sort_order="ascend")
        ]

    @_translated
    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        response = self._client.put(key, value, lease=lease)
        return int(response.header.revision)

    @_translated
    def put_if(
        self, key: str, value: bytes, *, expect: dict[str, int], lease: int | None = None
    ) -> int | None:
        tx = self._client.transactions
        compares = [
            tx.version(k) == 0 if rev == 0 else tx.mod(k) == rev for k, rev in expect.items()
        ]
        # The read after the write in the same transaction returns the revision the
        # write created: the caller's fencing token, with no second round trip.
        succeeded, responses = self._client.transaction(
            compare=compares, success=[tx.put(key, value, lease), tx.get(key)], failure=[]
        )
        if not succeeded:
            return None
        _value, meta = responses[1][0]
        return int(meta.mod_revision)

    @_translated
    def delete(self, key: str) -> bool:
        return bool(self._client.delete(key))

    @_translated
    def delete_prefix(self, prefix: str) -> None:
        self._client.delete_prefix(prefix)

    @_translated
    def grant_lease(self, ttl_seconds: int) -> int:
        return int(self._client.lease(ttl_seconds).id)

    @_translated
    def refresh_lease(self, lease_id: int) -> bool:
        responses = list(self._client.refresh_lease(lease_id))
        return bool(responses) and int(responses[0].TTL) > 0

    @_translated
    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._client.revoke_lease(lease_id)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    @_translated
    def revision(self) -> int:
        return int(self._client.status().raft_index)

    def on_change(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        watch = _Watch(self._client, prefix, callback)
        watch.arm()
        return watch.cancel

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a broken channel must not raise
            logger.debug("closing etcd client failed", exc_info=True)


class _Watch:
    """A prefix watch that re-arms itself after the stream breaks (etcd restarted).

    While etcd is away it retries every half second from a daemon thread; callers
    poll as well, so a missed event only costs them one poll interval.
    """

    def __init__(self, client: Any, prefix: str, callback: Callable[[], None]) -> None:
        self._client = client
        self._prefix = prefix
        self._callback = callback
        self._watch_id: int | None = None
        self._cancelled = threading.Event()

    def arm(self) -> None:
        try:
            self._watch_id = self._client.add_watch_prefix_callback(self._prefix, self._relay)
        except Exception:  # noqa: BLE001 - thread boundary: log and retry later
            logger.debug("watch on %s not armed; retrying", self._prefix, exc_info=True)
            self._rearm_later()

    def _relay(self, response: Any) -> None:
        self._callback()
        if isinstance(response, Exception) and not self._cancelled.is_set():
            self._rearm_later()

    def _rearm_later(self) -> None:
        def retry() -> None:
            if not self._cancelled.wait(0.5):
                self.arm()

        threading.Thread(target=retry, name="etcd-watch-rearm", daemon=True).start()

    def cancel(self) -> None:
        self._cancelled.set()
        if self._watch_id is not None:
            try:
                self._client.cancel_watch(self._watch_id)
            except Exception:  # noqa: BLE001 - a dead store has nothing left to cancel
                logger.debug("cancelling watch on %s failed", self._prefix, exc_info=True)
