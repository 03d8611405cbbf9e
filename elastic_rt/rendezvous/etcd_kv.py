"""The KVStore protocol over the etcd v3 API: the one blocking etcd client of the runtime.

Every etcd or gRPC failure is translated here, keeping the cause (``from exc``):
connection problems become :class:`StoreConnectionError` (retryable); a refused
certificate, password or permission becomes :class:`CredentialsError` (a user
mistake, printed as one line by the CLI); the wording is ``etcd_errors``'s, the
request messages ``etcd_messages``'s.

Security: TLS with an optional client certificate, and etcd's user/password auth.
The password is sent once per log-in and never logged; etcd's simple tokens die
when etcd restarts (and expire after ``--auth-token-ttl``), so a refused token is
renewed by logging in again and the call retried once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Any, Callable, Sequence, TypeVar

# gRPC's core logs an INFO line at every fork (the agent forks workers); keep errors only.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# Children are exec'd at once (see elastic_rt.childproc), so gRPC needs no fork handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import etcd3  # noqa: E402 - after the gRPC setting above
import etcd3.events  # noqa: E402
import etcd3.utils  # noqa: E402
import etcd3.watch  # noqa: E402
from etcd3 import etcdrpc  # noqa: E402
import grpc  # noqa: E402
import six  # noqa: E402

from elastic_rt.config import EtcdAuth  # noqa: E402
from elastic_rt.errors import (  # noqa: E402
    ConfigError,
    ElasticError,
    StoreConnectionError,
    StoreElectingError,
)
from elastic_rt.rendezvous.etcd_errors import SECURITY_GUIDE, translate  # noqa: E402
from elastic_rt.rendezvous.etcd_messages import pb_kv, txn_request, txn_result  # noqa: E402
from elastic_rt.rendezvous.kv import Change, KeyValue, TxnOp, TxnResult  # noqa: E402

logger = logging.getLogger(__name__)

# python3-etcd3 0.13's watch thread calls six.itervalues when a stream breaks but never
# imports six, so an etcd restart killed the thread with a NameError and every watch
# went silent. Supplying the module restores its own error path.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = six

T = TypeVar("T")


def _translated(method: Callable[..., T]) -> Callable[..., T]:
    """Log in first if needed, renew a dead token once, and translate every failure."""

    @functools.wraps(method)
    def wrapper(self: "EtcdKV", *args: Any, **kwargs: Any) -> T:
        what = method.__name__ + (f" {args[0]}" if args and isinstance(args[0], str) else "")
        try:
            if self._needs_login:
                self._login()
            try:
                return method(self, *args, **kwargs)
            except grpc.RpcError as exc:
                if not self._token_refused(exc):
                    raise
                logger.info("etcd at %s refused our auth token; logging in again", self.endpoint)
                self._login()
                return method(self, *args, **kwargs)
        except ElasticError:
            raise
        except (grpc.RpcError, etcd3.exceptions.Etcd3Exception, ValueError) as exc:
            raise translate(exc, what, endpoint=self.endpoint, auth=self._auth) from exc

    return wrapper


_REFUSED_WATCH = -1
"""The watch id etcd answers a create it refuses (permissions, a token it forgot) with;
python3-etcd3 returns it as if the watch existed."""
_REQUIRE_LEADER = ("hasleader", "true")
"""etcd's metadata for "answer at once if you have no leader" (clientv3.WithRequireLeader)."""
_NO_LEADER = "no leader"
"""In the details of etcd's answer to a call that requires a leader, when there is none."""
_LEADER_SILENT = "context deadline exceeded"
"""etcd's own words (Go's) when the call's deadline passed inside the member, waiting on its
leader; gRPC's client says "Deadline Exceeded" for a member that never answered."""

MEMBER_BENCH_S = 2.0
"""Seconds an unreachable cluster member is skipped before it is tried again."""


class _Members(etcd3.MultiEndpointEtcd3Client):
    """The client over a cluster's members, which never runs out of members to ask.

    The client benches a member that failed a call, so that the next goes to another;
    when every member is benched (an election after the leader's restart fails calls on
    all of them for a second or two) it fails every call with "No endpoint available"
    until a bench ends, without asking anyone. Here the member benched longest ago is
    asked instead: a lease renewed every tenth of a second while its fence nears must
    reach the member that answers first.
    """

    def _clear_old_stubs(self) -> None:
        """Keep the stubs, and the watcher with its stream, where there is no other member;
        with others, end the dropped watcher's stream.

        The client drops them after any call that fails with UNAVAILABLE or
        DEADLINE_EXCEEDED so that the next call goes to another member's channel. With
        one member the next call uses the same channel. Either way the dropped watcher's
        stream would live on half-closed, with its thread, delivering to the watches it
        holds until the member's connection ends, while watches armed later open another
        stream: one more stream and thread for every slow call, on a member that may live
        for months. Cancelled, its watches hear that their stream ended and arm again on
        the member now in use.
        """
        if len(self.endpoints) <= 1:
            return
        dropped = self._stubs.get("watcher")
        super()._clear_old_stubs()
        if dropped is not None:
            dropped._watch_stub.cancel()

    def get_watcher(self) -> etcd3.watch.Watcher:
        watcher = super().get_watcher()
        watcher._watch_stub = _CancellableWatchStub(watcher._watch_stub)
        return watcher

    @property
    def channel(self) -> Any:
        endpoints = list(self.endpoints.values())
        if self.failover and all(e.is_failed() for e in endpoints):
            min(endpoints, key=lambda e: e.last_failed).last_failed = 0
        return super().channel


class _CancellableWatchStub:
    """A watcher's stub that keeps the watch stream it opened, so that whoever drops the
    watcher can end it (python3-etcd3's watcher keeps no handle to its stream)."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._stream: Any = None

    def Watch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - gRPC's method name
        self._stream = self._stub.Watch(*args, **kwargs)
        return self._stream

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()


class EtcdKV:
    """KVStore on etcd: one endpoint, or the members of one cluster.

    With several members a call that finds its member unreachable fails (callers
    retry, as they do across an etcd restart) and the next call goes to another
    member; the unreachable one is left alone for ``MEMBER_BENCH_S``. Leases, keys
    and revisions are the cluster's, so nothing else changes.

    Args:
        endpoint: ``host:port``, or ``host:port,host:port,...`` for a cluster.
        auth: TLS files and user/password; the password is only handed to etcd.
        timeout: seconds for each unary call, so a dead etcd fails fast.

    Raises:
        ConfigError: a certificate or key file cannot be read.
        CredentialsError: etcd refused the user name or password.
    """

    def __init__(
        self, endpoint: str, *, auth: EtcdAuth | None = None, timeout: float = 5.0
    ) -> None:
        self.endpoint = endpoint
        self._auth = auth or EtcdAuth()
        self._timeout = timeout
        self._login_lock = threading.Lock()
        self._needs_login = self._auth.user is not None
        members = [m for m in endpoint.split(",") if m]
        secure = self._auth.is_tls
        if self._auth.user and not secure:
            logger.warning(
                "sending the etcd password of %s without TLS; see %s",
                self._auth.user,
                SECURITY_GUIDE,
            )
        # The client benches an endpoint for 300 s after one failed call by default. With a
        # single endpoint that turns an etcd restart of a second into five minutes of
        # errors, so time_retry=0 lets gRPC reconnect on the next call instead. With
        # several, a short bench makes the next call try another member.
        creds = _channel_credentials(self._auth) if secure else None
        # gRPC backs off up to seconds between reconnects; after an etcd restart that
        # delay alone could outlast a short lease, so reconnect within half a second.
        reconnect = {
            "grpc.initial_reconnect_backoff_ms": 100,
            "grpc.min_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 500,
        }
        bench = 0 if len(members) == 1 else MEMBER_BENCH_S
        nodes = [
            etcd3.Endpoint(host, int(port), secure=secure, creds=creds, time_retry=bench,
                           opts=list(reconnect.items()))
            for host, _, port in (member.rpartition(":") for member in members)
        ]
        self._client = _Members(endpoints=nodes, timeout=timeout, failover=len(nodes) > 1)
        if self._needs_login:
            try:
                self._login()
            except StoreConnectionError:
                # etcd may not be up yet: the first call logs in (and reports the outage).
                logger.debug("etcd at %s unreachable; logging in at the first call", endpoint)

    # security -------------------------------------------------------------------
    def _login(self) -> None:
        """Exchange user/password for a token and attach it to every later call."""
        request = etcd3.etcdrpc.AuthenticateRequest(
            name=self._auth.user, password=self._auth.password or ""
        )
        with self._login_lock:
            try:
                response = self._client.authstub.Authenticate(request, self._timeout)
            except grpc.RpcError as exc:
                disabled = "authentication is not enabled" in (exc.details() or "")
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and disabled:
                    logger.warning(
                        "etcd at %s has auth disabled; --etcd-user is not checked", self.endpoint
                    )
                    self._needs_login = False
                    return
                raise translate(exc, "log-in", endpoint=self.endpoint, auth=self._auth) from exc
            token = response.token
            self._client.metadata = (("token", token),)
            # Call credentials are refused on a plaintext channel; the metadata carries
            # the token there as well.
            creds = grpc.metadata_call_credentials(_Token(token)) if self._auth.is_tls else None
            self._client.call_credentials = creds
            watcher = self._client._stubs.get("watcher")
            if watcher is not None:  # it copied the old token when it was made
                watcher._metadata = self._client.metadata
                watcher._credentials = creds
            self._needs_login = False

    def _token_refused(self, exc: grpc.RpcError) -> bool:
        """A token etcd forgot (restart, TTL) or issued before a role change: log in again."""
        if self._auth.user is None:
            return False
        details = (exc.details() if hasattr(exc, "details") else None) or ""
        return "invalid auth token" in details or "auth store is old" in details

    # KVStore ----------------------------------------------------------------------
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
    def txn(self, expect: dict[str, int], success: Sequence[TxnOp],
            failure: Sequence[TxnOp] = ()) -> TxnResult:
        # The client's transaction() drops the header, and with it the revision the
        # reads were taken at, which a watch must start after; so call the stub.
        request = txn_request(expect, success, failure)
        response = self._failing_over(lambda: self._client.kvstub.Txn(
            request, self._timeout, credentials=self._client.call_credentials,
            metadata=self._client.metadata))
        return txn_result(response)

    def _failing_over(self, call: Callable[[], T]) -> T:
        """A call on a stub of ours, handled like the client's own (get, put, ...).

        The client benches a member that did not answer, so that the next call goes
        to another (``failover``), only inside its own methods; a stub called directly
        would keep every later call on the dead member. Its handler raises etcd3's
        error for the code, or the gRPC error itself (an auth error, renewed above).
        """
        try:
            return call()
        except grpc.RpcError as exc:
            self._client._manage_grpc_errors(exc)
            raise

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
    def refresh_lease(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Raises :class:`StoreElectingError` when the member has no leader: it says so at
        once (etcd's ``hasleader`` requirement) instead of holding the call; and when the
        member took the call and its leader did not answer it in time (etcd's own
        "context deadline exceeded", not the client's "Deadline Exceeded": the leader it
        forwards renewals to is gone, and an election is coming). The member is benched,
        so that the next call asks another."""
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        metadata = (*(self._client.metadata or ()), _REQUIRE_LEADER)

        def renew() -> list[Any]:
            try:
                return list(self._client.leasestub.LeaseKeepAlive(
                    iter([request]), timeout or self._timeout,
                    credentials=self._client.call_credentials, metadata=metadata))
            except grpc.RpcError as exc:
                details = exc.details() or ""
                if _NO_LEADER not in details and _LEADER_SILENT not in details:
                    raise
                with contextlib.suppress(etcd3.exceptions.Etcd3Exception, grpc.RpcError):
                    self._client._manage_grpc_errors(exc)  # benches the member
                raise StoreElectingError(f"etcd member {self._client.endpoint_in_use.netloc} "
                                         f"could not reach a leader ({details})") from exc

        responses = self._failing_over(renew)
        return bool(responses) and int(responses[0].TTL) > 0

    @_translated
    def refresh_leases(self, lease_ids: Sequence[int]) -> list[bool]:
        requests = [etcdrpc.LeaseKeepAliveRequest(ID=lease_id) for lease_id in lease_ids]

        def renew() -> dict[int, int]:
            responses = self._client.leasestub.LeaseKeepAlive(
                iter(requests), self._timeout, credentials=self._client.call_credentials,
                metadata=self._client.metadata)
            return {int(r.ID): int(r.TTL) for r in responses}

        ttls = self._failing_over(renew)
        return [ttls.get(lease_id, 0) > 0 for lease_id in lease_ids]

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
        watch = _Watch(self, prefix, callback)
        watch.arm()
        return watch.cancel

    def watch_changes(self, prefix: str, callback: Callable[[list[Change] | None], None], *,
                      start_revision: int) -> Callable[[], None]:
        def relay(response: Any) -> None:
            if _stream_ended(response):
                callback(None)
                return
            callback([Change(pb_kv(event._event.kv),
                             isinstance(event, etcd3.events.DeleteEvent))
                      for event in response.events])

        return self._watch(prefix, relay, start_revision=start_revision)

    @_translated
    def _watch(self, prefix: str, relay: Callable[[Any], None], *,
               start_revision: int | None = None) -> Callable[[], None]:
        """Watch ``prefix``; returns the cancel of that watch on the stream that holds it.

        The client replaces its watcher (and its stream) after any call that fails with
        UNAVAILABLE or DEADLINE_EXCEEDED, and watch ids count from 0 on each stream, so
        cancelling by id on whichever watcher is current could end another caller's watch.
        """
        watcher = self._client.watcher
        end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
        try:
            watch_id = watcher.add_callback(prefix, relay, range_end=end,
                                            start_revision=start_revision)
        except grpc.RpcError as exc:
            self._client._manage_grpc_errors(exc)  # benches the member and raises, as its calls do
        if watch_id == _REFUSED_WATCH:
            watcher.cancel(watch_id)
            self._needs_login = self._auth.user is not None  # a stale token is the usual cause
            raise StoreConnectionError(f"etcd at {self.endpoint} refused a watch on {prefix}")

        def cancel() -> None:
            try:
                watcher.cancel(watch_id)
            except Exception:  # noqa: BLE001 - a dead store has nothing left to cancel
                logger.debug("cancelling watch on %s failed", prefix, exc_info=True)

        return cancel

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a broken channel must not raise
            logger.debug("closing etcd client failed", exc_info=True)


def _channel_credentials(auth: EtcdAuth) -> grpc.ChannelCredentials:
    """TLS credentials from the PEM files; no CA file means the system's CA bundle."""
    if bool(auth.cert) != bool(auth.key):
        raise ConfigError("--etcd-cert and --etcd-key go together", "Pass both or neither.")
    contents: dict[str, bytes | None] = {}
    files = (("--etcd-cacert", auth.cacert), ("--etcd-cert", auth.cert), ("--etcd-key", auth.key))
    for flag, path in files:
        if path is None:
            contents[flag] = None
            continue
        try:
            with open(path, "rb") as handle:
                contents[flag] = handle.read()
        except OSError as exc:
            raise ConfigError(
                f"{flag} {path} cannot be read ({exc.strerror})",
                "Check the path and its permissions.",
            ) from exc
    return grpc.ssl_channel_credentials(
        root_certificates=contents["--etcd-cacert"],
        private_key=contents["--etcd-key"],
        certificate_chain=contents["--etcd-cert"],
    )


class _Token(grpc.AuthMetadataPlugin):
    """Hands etcd's auth token to gRPC on a TLS channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context: Any, callback: Any) -> None:
        callback((("token", self._token),), None)


def _stream_ended(response: Any) -> bool:
    """Whether a watch callback says its stream is gone rather than delivering events.

    A broken stream calls back with its error; one that ended without an error, with
    None (python3-etcd3 half-closes a watcher's stream when it drops the watcher after a
    unary call failed with UNAVAILABLE or DEADLINE_EXCEEDED; etcd keeps serving such a
    stream, but once it ends, that is how). Either way the watch is gone: arm a new one.
    """
    return not isinstance(response, etcd3.watch.WatchResponse)


class _Watch:
    """A prefix watch that re-arms itself after the stream breaks (etcd restarted).

    While etcd is away it retries every half second from a daemon thread; callers
    poll as well, so a missed event only costs them one poll interval.
    """

    def __init__(self, kv: EtcdKV, prefix: str, callback: Callable[[], None]) -> None:
        self._kv = kv
        self._prefix = prefix
        self._callback = callback
        self._cancel_armed: Callable[[], None] | None = None
        self._cancelled = threading.Event()

    def arm(self) -> None:
        try:
            self._cancel_armed = self._kv._watch(self._prefix, self._relay)
        except Exception:  # noqa: BLE001 - thread boundary: log and retry later
            logger.debug("watch on %s not armed; retrying", self._prefix, exc_info=True)
            self._rearm_later()

    def _relay(self, response: Any) -> None:
        if self._cancelled.is_set():
            return  # a stream the client dropped can deliver after the cancel
        self._callback()
        if _stream_ended(response):
            self._rearm_later()

    def _rearm_later(self) -> None:
        def retry() -> None:
            if not self._cancelled.wait(0.5):
                self.arm()

        threading.Thread(target=retry, name="etcd-watch-rearm", daemon=True).start()

    def cancel(self) -> None:
        self._cancelled.set()
        if self._cancel_armed is not None:
            self._cancel_armed()
