"""The key-value seam: what the rendezvous needs from etcd, as a Protocol.

Only :mod:`elastic_rt.rendezvous.etcd_kv` implements it against etcd. Keeping the
surface this small (get, compare-and-put, leases, a change signal) keeps every
protocol decision out of the adapter and lets the contract test run the same
assertions against any implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as read, with the revisions that make compare-and-put possible."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Put:
    """A write inside :meth:`KVStore.txn`."""

    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True, slots=True)
class Get:
    """A read inside :meth:`KVStore.txn`: one key, or every key under it with ``prefix``."""

    key: str
    prefix: bool = False
    limit: int = 0
    """At most this many keys (0: all): enough to learn whether any exist."""


@dataclass(frozen=True, slots=True)
class Delete:
    """A delete inside :meth:`KVStore.txn` (absent keys are no error): a node leaving at a
    step boundary writes the round without it and drops its registration in one transaction,
    so the leader never sees it registered outside the round (and admits it again)."""

    key: str


TxnOp = Put | Get | Delete


@dataclass(frozen=True, slots=True)
class TxnRequest:
    """One :meth:`KVStore.txn`, built apart from sending it.

    The rendezvous builds its transactions as data (registry.py) so that the same
    request is sent by the agent's blocking client and by an asyncio one
    (agents/sim/etcd_aio.py, the swarm simulator's): one protocol, two
    ways to carry it.
    """

    expect: dict[str, int]
    success: tuple[TxnOp, ...]
    failure: tuple[TxnOp, ...] = ()


@dataclass(frozen=True, slots=True)
class PutIf:
    """One :meth:`KVStore.put_if`, built apart from sending it (see :class:`TxnRequest`)."""

    key: str
    value: bytes
    expect: dict[str, int]


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    """Whether every comparison held (the success branch ran)."""
    revision: int
    """The store's revision after the transaction: what it read is as of this revision."""
    reads: list[list[KeyValue]]
    """One list per :class:`Get` of the branch that ran, in order (empty: no such key)."""


@dataclass(frozen=True, slots=True)
class Change:
    """One event of :meth:`KVStore.watch_changes`: the key as written, or as deleted."""

    kv: KeyValue
    deleted: bool


@runtime_checkable
class KVStore(Protocol):
    """A strongly consistent key-value store with leases and transactions.

    Revisions are the store's global counter; a key's ``mod_revision`` is the
    revision of its last write, which doubles as our fencing token.
    """

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Write unconditionally; returns the new revision."""
        ...

    def put_if(
        self,
        key: str,
        value: bytes,
        *,
        expect: dict[str, int],
        lease: int | None = None,
    ) -> int | None:
        """Write only if every key in ``expect`` has that mod_revision (0: absent).

        Returns the new revision, or None when a comparison failed.
        """
        ...

    def txn(self, expect: dict[str, int], success: Sequence[TxnOp],
            failure: Sequence[TxnOp] = ()) -> TxnResult:
        """Run ``success`` if every key in ``expect`` has that mod_revision (0: absent),
        else ``failure``; one round trip, atomic, so reads see the writes before them."""
        ...

    def delete(self, key: str) -> bool: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def grant_lease(self, ttl_seconds: int) -> int: ...

    def refresh_lease(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Keep a lease alive; False when it has already expired. ``timeout``: the most
        seconds the call may take (the store's default when None): a keeper of a short
        lease gives much less than the lease's life, so that a member that takes the call
        but cannot answer it (restarting, or without a leader) leaves time to try another."""
        ...

    def refresh_leases(self, lease_ids: Sequence[int]) -> list[bool]:
        """Keep many leases alive in one call (one keep-alive stream); per lease, False
        when it has already expired. How a process holding many nodes' leases (an
        agent group, a simulator) renews them without a call per lease."""
        ...

    def revoke_lease(self, lease_id: int) -> None: ...

    def on_change(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from another thread) after any write under ``prefix``.

        Returns a function that cancels the watch. A broken watch (store restarted)
        calls ``callback`` once more and then stays silent; callers also poll.
        """
        ...

    def watch_changes(self, prefix: str, callback: Callable[[list[Change] | None], None], *,
                      start_revision: int) -> Callable[[], None]:
        """Deliver every change under ``prefix`` from ``start_revision`` on, in order.

        Unlike :meth:`on_change` the events carry the keys, so a reader that read
        everything at revision R and watches from R + 1 holds a current copy without
        reading again. ``callback(None)`` means the stream broke (events may be
        lost): read afresh and watch again. Returns a function that cancels it.
        """
        ...

    def close(self) -> None: ...
