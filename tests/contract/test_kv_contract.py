"""The KVStore contract: what the rendezvous relies on from its store.

:class:`KVStoreContract` holds the assertions; each implementation gets a subclass
that provides the ``kv`` fixture. Today that is only :class:`EtcdKV` against a
real etcd; an in-memory store for unit tests would subclass it as well.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Iterator

import pytest

from elastic_rt.errors import StoreConnectionError
from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import Change, Delete, Get, KVStore, Put
from tests.fixtures.etcd import put_and_see, times_out_while_stopped, watch_threads

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


class KVStoreContract:
    """Subclasses provide a ``kv`` fixture; keys live under a fresh ``prefix``."""

    @pytest.fixture()
    def prefix(self) -> str:
        return f"/contract/{uuid.uuid4().hex[:8]}/"

    def test_is_a_kvstore(self, kv: KVStore) -> None:
        assert isinstance(kv, KVStore)

    def test_get_of_a_missing_key_is_none(self, kv: KVStore, prefix: str) -> None:
        assert kv.get(prefix + "missing") is None

    def test_put_returns_the_revision_get_reports(self, kv: KVStore, prefix: str) -> None:
        first = kv.put(prefix + "k", b"one")
        item = kv.get(prefix + "k")
        assert item is not None
        assert (item.key, item.value, item.mod_revision, item.create_revision, item.lease) == (
            prefix + "k", b"one", first, first, 0
        )  # fmt: skip
        second = kv.put(prefix + "k", b"two")
        item = kv.get(prefix + "k")
        assert second > first
        assert item is not None and (item.mod_revision, item.create_revision) == (second, first)

    def test_get_prefix_returns_only_that_prefix_sorted_by_key(
        self, kv: KVStore, prefix: str
    ) -> None:
        for key in ("b", "a", "c/d"):
            kv.put(prefix + "in/" + key, key.encode())
        kv.put(prefix + "inside", b"sibling")
        kv.put(prefix + "out/a", b"x")
        items = kv.get_prefix(prefix + "in/")
        assert [i.key for i in items] == [prefix + "in/a", prefix + "in/b", prefix + "in/c/d"]
        assert [i.value for i in items] == [b"a", b"b", b"c/d"]
        assert kv.get_prefix(prefix + "nothing/") == []

    def test_put_if_absent_succeeds_once(self, kv: KVStore, prefix: str) -> None:
        key = prefix + "once"
        revision = kv.put_if(key, b"first", expect={key: 0})
        assert revision is not None
        assert kv.put_if(key, b"second", expect={key: 0}) is None
        item = kv.get(key)
        assert item is not None and (item.value, item.mod_revision) == (b"first", revision)

    def test_put_if_compares_the_mod_revision(self, kv: KVStore, prefix: str) -> None:
        key = prefix + "round"
        first = kv.put(key, b"r0")
        second = kv.put_if(key, b"r1", expect={key: first})
        assert second is not None and second > first
        assert kv.put_if(key, b"stale", expect={key: first}) is None
        item = kv.get(key)
        assert item is not None and (item.value, item.mod_revision) == (b"r1", second)

    def test_put_if_can_fence_on_another_key(self, kv: KVStore, prefix: str) -> None:
        token = kv.put(prefix + "round", b"r0")
        assert kv.put_if(prefix + "commit", b"c0", expect={prefix + "round": token}) is not None
        kv.put(prefix + "round", b"r1")
        assert kv.put_if(prefix + "commit", b"late", expect={prefix + "round": token}) is None
        item = kv.get(prefix + "commit")
        assert item is not None and item.value == b"c0"

    def test_only_one_of_many_concurrent_proposers_wins(self, kv: KVStore, prefix: str) -> None:
        key = prefix + "round"
        results: list[int | None] = []
        start = threading.Barrier(8)

        def propose(i: int) -> None:
            start.wait()
            results.append(kv.put_if(key, str(i).encode(), expect={key: 0}))

        threads = [threading.Thread(target=propose, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        winners = [r for r in results if r is not None]
        assert len(results) == 8 and len(winners) == 1
        item = kv.get(key)
        assert item is not None and item.mod_revision == winners[0]

    def test_delete_and_delete_prefix(self, kv: KVStore, prefix: str) -> None:
        kv.put(prefix + "a", b"1")
        assert kv.delete(prefix + "a") is True
        assert kv.delete(prefix + "a") is False
        assert kv.get(prefix + "a") is None
        for key in ("x/1", "x/2", "y"):
            kv.put(prefix + key, b"v")
        kv.delete_prefix(prefix + "x/")
        assert [i.key for i in kv.get_prefix(prefix)] == [prefix + "y"]

    def test_revoking_a_lease_deletes_its_keys(self, kv: KVStore, prefix: str) -> None:
        lease = kv.grant_lease(30)
        kv.put(prefix + "node", b"n", lease=lease)
        item = kv.get(prefix + "node")
        assert item is not None and item.lease == lease
        kv.revoke_lease(lease)
        assert kv.get(prefix + "node") is None
        kv.revoke_lease(lease)  # revoking twice is harmless

    def test_an_unrefreshed_lease_expires_with_its_keys(self, kv: KVStore, prefix: str) -> None:
        lease = kv.grant_lease(2)
        kv.put(prefix + "node", b"n", lease=lease)
        wait_until(lambda: kv.get(prefix + "node") is None, 10, "the lease to expire")
        assert kv.refresh_lease(lease) is False

    def test_a_refreshed_lease_outlives_its_ttl(self, kv: KVStore, prefix: str) -> None:
        lease = kv.grant_lease(2)
        kv.put(prefix + "node", b"n", lease=lease)
        until = time.monotonic() + 3.5
        while time.monotonic() < until:
            assert kv.refresh_lease(lease) is True
            time.sleep(0.5)
        assert kv.get(prefix + "node") is not None
        kv.revoke_lease(lease)

    def test_refresh_leases_renews_many_and_names_the_expired(self, kv: KVStore) -> None:
        alive, gone = kv.grant_lease(5), kv.grant_lease(5)
        kv.revoke_lease(gone)
        assert kv.refresh_leases([alive, gone, alive]) == [True, False, True]
        kv.revoke_lease(alive)

    def test_on_change_fires_for_writes_under_the_prefix_until_cancelled(
        self, kv: KVStore, prefix: str
    ) -> None:
        fired = threading.Event()
        cancel = kv.on_change(prefix + "watched/", fired.set)
        try:
            kv.put(prefix + "elsewhere", b"x")
            kv.put(prefix + "watched/a", b"1")
            assert fired.wait(5), "no callback for a put"
            fired.clear()
            kv.delete(prefix + "watched/a")
            assert fired.wait(5), "no callback for a delete"
        finally:
            cancel()
        fired.clear()
        kv.put(prefix + "watched/b", b"2")
        marker = threading.Event()
        cancel_marker = kv.on_change(prefix + "marker", marker.set)
        kv.put(prefix + "marker", b"m")  # once this arrives, an earlier event would have too
        assert marker.wait(5)
        cancel_marker()
        assert not fired.is_set(), "a cancelled watch still fired"

    def test_txn_runs_one_branch_and_reads_after_its_writes(
        self, kv: KVStore, prefix: str
    ) -> None:
        kv.put(prefix + "n/a", b"a")
        first = kv.txn({prefix + "claim": 0},
                       [Put(prefix + "claim", b"me"), Put(prefix + "n/b", b"b"),
                        Get(prefix + "n/", prefix=True)],
                       [Get(prefix + "claim")])
        assert first.succeeded
        assert [i.key for i in first.reads[0]] == [prefix + "n/a", prefix + "n/b"]
        assert first.reads[0][1].mod_revision == first.revision
        second = kv.txn({prefix + "claim": 0}, [Put(prefix + "claim", b"other")],
                        [Get(prefix + "claim"), Get(prefix + "missing")])
        assert not second.succeeded
        assert [i.value for i in second.reads[0]] == [b"me"] and second.reads[1] == []
        assert second.revision == first.revision  # nothing written
        limited = kv.txn({}, [Get(prefix + "n/", prefix=True, limit=1)])
        assert [i.key for i in limited.reads[0]] == [prefix + "n/a"]

    def test_txn_deletes_with_its_writes_or_not_at_all(self, kv: KVStore, prefix: str) -> None:
        kv.put(prefix + "n/me", b"registered")
        guard = kv.put(prefix + "round", b"1")
        stale = kv.txn({prefix + "round": guard - 1},
                       [Put(prefix + "round", b"2"), Delete(prefix + "n/me")])
        assert not stale.succeeded and kv.get(prefix + "n/me") is not None
        done = kv.txn({prefix + "round": guard},
                      [Put(prefix + "round", b"2"), Delete(prefix + "n/me"),
                       Delete(prefix + "n/never"), Get(prefix + "n/", prefix=True)])
        assert done.succeeded and done.reads == [[]]
        item = kv.get(prefix + "round")
        assert item is not None and item.value == b"2" and kv.get(prefix + "n/me") is None

    def test_watch_changes_delivers_values_and_deletes_from_a_revision(
        self, kv: KVStore, prefix: str
    ) -> None:
        start = kv.put(prefix + "w/a", b"1")  # before the watch, but at its start revision
        events: queue.Queue[list[Change] | None] = queue.Queue()
        cancel = kv.watch_changes(prefix + "w/", events.put, start_revision=start)
        try:
            kv.put(prefix + "w/b", b"2")
            kv.put(prefix + "other", b"x")
            kv.delete(prefix + "w/a")
            seen: list[tuple[str, bytes, bool]] = []
            deadline = time.monotonic() + 5
            while len(seen) < 3 and time.monotonic() < deadline:
                batch = events.get(timeout=max(0.01, deadline - time.monotonic()))
                assert batch is not None
                seen += [(c.kv.key[len(prefix):], c.kv.value, c.deleted) for c in batch]
            assert seen == [("w/a", b"1", False), ("w/b", b"2", False), ("w/a", b"", True)]
        finally:
            cancel()


class TestEtcdKV(KVStoreContract):
    @pytest.fixture()
    def kv(self, etcd_kv: EtcdKV) -> EtcdKV:
        return etcd_kv


class TestEtcdKVAcrossRestarts:
    """What only a real etcd can show: a restart under a live client."""

    @pytest.fixture()
    def kv(self, fresh_etcd: EtcdServer) -> Iterator[EtcdKV]:
        kv = EtcdKV(fresh_etcd.endpoint, timeout=2)
        yield kv
        kv.close()

    def test_on_change_survives_an_etcd_restart(self, kv: EtcdKV, fresh_etcd: EtcdServer) -> None:
        fired = threading.Event()
        cancel = kv.on_change("/restart/", fired.set)
        try:
            kv.put("/restart/before", b"1")
            assert fired.wait(5)
            fired.clear()
            fresh_etcd.kill()
            fresh_etcd.restart()
            # The broken stream calls back once; then the re-armed watch sees new writes.
            assert fired.wait(10), "no callback when the watch broke"
            wait_until(lambda: put_and_see(kv, fired), 20, "the watch to re-arm")
            assert kv.get("/restart/before") is not None  # data survived the restart
        finally:
            cancel()

    def test_a_cancel_ends_only_its_own_watch_after_a_call_timed_out(
        self, fresh_etcd: EtcdServer
    ) -> None:
        # Over two members (here one etcd under two loopback names) a call that times out
        # makes the client move to the other and start a new watch stream there, whose
        # ids count from 0 again: a cancel must go to the stream holding its watch.
        port = fresh_etcd.endpoint.rpartition(":")[2]
        kv = EtcdKV(f"{fresh_etcd.endpoint},localhost:{port}", timeout=2)
        first_fired, second_fired = threading.Event(), threading.Event()
        try:
            cancel_first = kv.on_change("/restart/first/", first_fired.set)
            wait_until(lambda: put_and_see(kv, first_fired, "/restart/first/k"), 10,
                       "the first watch to fire")
            times_out_while_stopped(kv, fresh_etcd, "/restart/first/k")  # on to the other member
            cancel_second = kv.on_change("/restart/", second_fired.set)
            cancel_first()
            wait_until(lambda: put_and_see(kv, second_fired), 10, "the second watch to fire")
            first_fired.clear()
            second_fired.clear()
            kv.put("/restart/first/k", b"2")
            assert second_fired.wait(5) and not first_fired.is_set()  # the cancelled one is quiet
            cancel_second()
        finally:
            kv.close()

    def test_calls_that_time_out_leave_no_watch_stream_behind(
        self, kv: EtcdKV, fresh_etcd: EtcdServer
    ) -> None:
        # With one member a failed call has no other channel to move to: the watch stream
        # and its thread are kept, where a dropped one would live on half-closed beside the
        # next watch's new stream (one more thread for every slow call).
        fired = threading.Event()
        cancel = kv.on_change("/restart/", fired.set)
        try:
            wait_until(lambda: put_and_see(kv, fired), 10, "the watch to fire")
            streams = watch_threads()
            for _ in range(3):
                times_out_while_stopped(kv, fresh_etcd, "/restart/k")
                again = threading.Event()  # as a round's watch is armed after a failure
                cancel_again = kv.on_change("/restart/", again.set)
                wait_until(lambda: put_and_see(kv, again), 10, "the new watch to fire")
                cancel_again()
            assert watch_threads() <= streams  # another test's closed client may end one
        finally:
            cancel()

    def test_calls_to_a_dead_etcd_raise_store_connection_error(
        self, kv: EtcdKV, fresh_etcd: EtcdServer
    ) -> None:
        kv.put("/dead/k", b"v")
        fresh_etcd.kill()
        with pytest.raises(StoreConnectionError):
            kv.get("/dead/k")
        fresh_etcd.restart()
        wait_until(lambda: _answers(kv), 20, "the client to reconnect")
        item = kv.get("/dead/k")
        assert item is not None and item.value == b"v"


def _answers(kv: KVStore) -> bool:
    try:
        kv.get("/dead/k")
    except StoreConnectionError:
        return False
    return True
