"""A node's registration on a lease kept alive from a thread, with self-fencing.

The shape of etcd's own ``Session``: a lease kept alive for the lifetime of a
client. If the keeper cannot renew for ``ttl - margin`` seconds, the others may
already have declared this node dead, so it calls ``on_fenced`` *before* the TTL
runs out: the agent stops its workers, and a cut-off node never trains on alone.
When the store answers again, the node registers afresh on a new lease.

How a node registers on a lease is its caller's (the agent joins with one
transaction that also reads the run, agents/run_watch.py); the keeper only owns
the lease.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from datetime import timedelta
from typing import Callable

from elastic_rt.errors import CredentialsError, StoreElectingError, StoreError
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import NodeInfo

logger = logging.getLogger(__name__)

RETRY_S = 0.1
"""Seconds between renewals after one failed, until one succeeds."""


class LeaseKeeper:
    """Registers ``info`` under a lease of ``ttl`` and keeps it alive.

    Args:
        registry: the run's keys.
        info: this node's record.
        ttl: lease time-to-live; etcd grants whole seconds, so a fraction rounds up.
        on_fenced: called from the keeper thread when renewal has failed for
            ``ttl - margin`` seconds, or the lease was found expired.
        register: registers the node on a new lease (its id), at start and after
            each fence; a store error it raises is retried at the next renewal.
        rejoin: register afresh by itself once the store answers after a fence; False:
            stop at the fence, and the owner registers again when it is ready (an agent
            whose workers must start first, see ``agents.policy.StartInStandby``).
    """

    def __init__(
        self,
        registry: RunRegistry,
        info: NodeInfo,
        ttl: timedelta,
        *,
        on_fenced: Callable[[str], None],
        register: Callable[[int], None],
        rejoin: bool = True,
    ) -> None:
        self.registry = registry
        self.info = info
        self.ttl = ttl.total_seconds()
        self.margin = min(1.0, self.ttl / 3)
        self.on_fenced = on_fenced
        self.register = register
        self.rejoin = rejoin
        self.lease_id: int | None = None
        self.is_fenced = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._last_renewed = 0.0
        self.failed_at: float | None = None
        """When a renewal last failed (monotonic), if one did: this node may have been cut
        off then (its heartbeats do not blame a peer's silence on the peer)."""

    @property
    def is_started(self) -> bool:
        """Whether :meth:`start` registered the node and keeps it alive (a start that
        raised may be called again)."""
        return self._thread.ident is not None

    def start(self) -> None:
        """Register now (raising store errors to the caller), then keep alive."""
        self._register()
        self._thread.start()

    def _register(self) -> None:
        self.lease_id = self.registry.kv.grant_lease(max(1, math.ceil(self.ttl)))
        self.register(self.lease_id)
        self._last_renewed = time.monotonic()
        self.is_fenced = False

    def _run(self) -> None:
        """Renew every quarter of the TTL; fence after ``ttl - margin`` without a renewal.

        A renewal may take a sixth of the TTL: a member that takes the call and cannot
        answer (an etcd member restarting, not yet back in its cluster) fails it fast, the
        client benches it, and the retry goes to another (soak finding 14: at the client's
        default of 5 s, one hung renewal outlived a 3 s lease while the node trained on).
        After a failure the renewals come every ``RETRY_S`` until one succeeds: the
        member that answers first after an election (or a restart of the one in use) is
        found within that, not a quarter of the TTL later (two back-to-back restarts of
        the leader fenced a node whose third try came after its fence). A member without a
        leader says so at once, and one whose leader is gone says its own deadline passed
        (``StoreElectingError``, an election after the leader restarted): no lease can
        expire without a leader, and the next leader renews them all, so that answer holds
        the fence off, by one TTL at most (a member cut off from the others' majority says
        the same, and there the lease may run out).
        """
        interval = max(0.2, self.ttl / 4)
        call_timeout = max(0.3, self.ttl / 6)
        wait = interval
        electing_since: float | None = None
        while not self._stop.wait(wait):
            wait = interval
            try:
                if self.is_fenced:
                    self._register()
                    logger.info("re-registered %s on lease %x", self.info.node_id, self.lease_id)
                    continue
                assert self.lease_id is not None
                if self.registry.kv.refresh_lease(self.lease_id, timeout=call_timeout):
                    self._last_renewed, electing_since = time.monotonic(), None
                else:
                    self._fence("lease expired")
            except (StoreError, CredentialsError) as exc:
                # Refused credentials (a revoked role) fence like a lost connection.
                logger.debug("lease renewal failed: %s", exc)
                now = time.monotonic()
                wait = min(interval, RETRY_S)  # to the next member, soon
                self.failed_at = now
                if isinstance(exc, StoreElectingError):
                    electing_since = electing_since or now
                held_off = electing_since is not None and now - electing_since < self.ttl
                silent = now - self._last_renewed
                if not self.is_fenced and not held_off and silent > self.ttl - self.margin:
                    self._fence(f"could not renew the lease for {self.ttl - self.margin:.1f} s")
            except Exception:  # noqa: BLE001 - thread boundary: log, keep the node fenced-safe
                logger.exception("lease keeper error")

    def _fence(self, why: str) -> None:
        self.is_fenced = True
        if not self.rejoin:
            self._stop.set()  # the owner registers on a new keeper when it is ready
        logger.warning("node %s fenced itself: %s", self.info.node_id, why)
        self.on_fenced(why)

    def stop(self, *, revoke: bool = True) -> None:
        """Stop renewing; with ``revoke`` the registration goes at once (a graceful leave)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if revoke and self.lease_id is not None and not self.is_fenced:
            try:
                self.registry.kv.revoke_lease(self.lease_id)
            except StoreError:
                logger.debug("revoking lease on leave failed", exc_info=True)
