"""The lease keeper's fence against a store that fails renewals in two ways: unreachable
(a cut-off node: fence before the TTL runs out) and electing (no leader: no lease can
expire, and the next leader renews them all: held off, by one TTL at most)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from elastic_rt.errors import StoreConnectionError, StoreElectingError, StoreError
from elastic_rt.harness import wait_until
from elastic_rt.harness.waits import WaitTimeout
from elastic_rt.rendezvous.lease import RETRY_S, LeaseKeeper
from elastic_rt.rendezvous.rounds import NodeInfo


class _Store:
    """Grants leases; renewals answer or fail with ``failure`` once ``failing`` is set."""

    def __init__(self, failure: type[StoreError]) -> None:
        self.failure, self.failing = failure, threading.Event()
        self.timeouts: list[float | None] = []

    def grant_lease(self, ttl_seconds: int) -> int:
        return 1

    def refresh_lease(self, lease_id: int, *, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        if self.failing.is_set():
            raise self.failure("renewal failed")
        return True


class _Registry:
    def __init__(self, kv: _Store) -> None:
        self.kv = kv


def _failing_keeper(failure: type[StoreError]) -> tuple[LeaseKeeper, _Store,
                                                        list[tuple[float, str]], float]:
    """A keeper of a 1.5 s lease (its fence at 1.0 s) whose renewals fail from the returned
    time on, and the (time, why) of each fence."""
    store, fenced = _Store(failure), list[tuple[float, str]]()
    keeper = LeaseKeeper(_Registry(store), NodeInfo("n1", "127.0.0.1", 1),  # type: ignore[arg-type]
                         timedelta(seconds=1.5),
                         on_fenced=lambda why: fenced.append((time.monotonic(), why)),
                         register=lambda lease: None)
    keeper.start()
    wait_until(lambda: store.timeouts or None, 5, "a renewal")
    store.failing.set()
    return keeper, store, fenced, time.monotonic()


def test_an_unreachable_store_fences_the_node_before_its_lease_runs_out() -> None:
    keeper, store, fenced, began = _failing_keeper(StoreConnectionError)
    try:
        wait_until(lambda: fenced or None, 5, "the fence")
        assert fenced[0][0] - began < 1.5  # the TTL: the others may drop it after that
        assert max(t for t in store.timeouts if t is not None) <= 0.3  # short calls
    finally:
        keeper.stop(revoke=False)


def test_a_store_without_a_leader_holds_the_fence_off_for_one_ttl_at_most() -> None:
    keeper, _, fenced, began = _failing_keeper(StoreElectingError)
    try:
        with pytest.raises(WaitTimeout):  # the unreachable store's fence came before this
            wait_until(lambda: fenced or None, 1.3, "the fence")
        wait_until(lambda: fenced or None, 5, "the fence once the hold-off is over")
        assert fenced[0][0] - began < 1.5 + 1.5  # the hold-off is one TTL at most
    finally:
        keeper.stop(revoke=False)


def test_after_a_failed_renewal_the_next_ones_come_soon_not_a_quarter_ttl_later() -> None:
    # A 1.5 s lease renews every 0.375 s; once one fails, every RETRY_S until the fence
    # (two leader restarts back to back left a 3 s lease's keeper three tries in its 2 s)
    keeper, store, fenced, began = _failing_keeper(StoreConnectionError)
    try:
        wait_until(lambda: fenced or None, 5, "the fence")
        tries = len(store.timeouts) - 1  # the first renewal succeeded
        assert tries >= 0.5 / RETRY_S, tries  # 1.0 s to the fence, less the calls' time
    finally:
        keeper.stop(revoke=False)


def test_a_client_whose_members_are_all_benched_asks_the_one_benched_longest_ago() -> None:
    # etcd3's client would fail every call with "No endpoint available" until a bench ends
    from elastic_rt.rendezvous.etcd_kv import EtcdKV

    kv = EtcdKV("127.0.0.1:1,127.0.0.1:2")  # channels connect lazily: no server needed
    try:
        first, second = kv._client.endpoints.values()
        second.fail()
        first.fail()
        first.last_failed = second.last_failed + 1.0  # benched after the second
        assert kv._client.channel is second.channel
        assert not second.is_failed() and first.is_failed()
    finally:
        kv.close()
