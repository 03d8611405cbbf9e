"""The key-value seam: what the rendezvous needs from etcd, as a Protocol.

Only :mod:`elastic_rt.rendezvous.etcd_kv` implements it against etcd. Keeping the
surface this small (get, compare-and-put, leases, a change signal) keeps every
protocol decision out of the adapter and lets the contract test run the same
assertions against any implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as read, with the revisions that make compare-and-put possible."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


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

    def delete(self, key: str) -> bool: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def grant_lease(self, ttl_seconds: int) -> int: ...

    def refresh_lease(self, lease_id: int) -> bool:
        """Keep a lease alive; False when it has already expired."""
        ...

    def revoke_lease(self, lease_id: int) -> None: ...

    def on_change(
        self, prefix: str, callback: Callable[[], None], *, deletes_only: bool = False
    ) -> Callable[[], None]:
        """Call ``callback`` (from another thread) after any write under ``prefix``.

        With ``deletes_only``, only after deletions (a lease expiring, a node leaving).

        Returns a function that cancels the watch. A broken watch (store restarted)
        calls ``callback`` once more and then stays silent; callers also poll.
        """
        ...

    def close(self) -> None: ...
