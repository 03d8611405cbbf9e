"""How the agent and the workers read a round's store address: one poll, one parse, and
the worker's retry while etcd fails a read."""

from __future__ import annotations

import threading
import types
from datetime import timedelta

import pytest

from agents.round_io import agree_on_store
from elastic_rt.config import WorkerEnv
from elastic_rt.errors import RendezvousTimeoutError, StoreConnectionError
from elastic_rt.rendezvous.kv import KeyValue
from elastic_rt.rendezvous.registry import RunRegistry, store_endpoint
from elastic_rt.rendezvous.rounds import NodeInfo, Round
from elastic_rt.worker.membership import RoundFollower


class _Published:
    """A store whose ``store/<k>`` key appears after ``after`` reads."""

    def __init__(self, address: str | None, after: int = 0) -> None:
        self.address, self.after, self.reads = address, after, 0

    def get(self, key: str) -> KeyValue | None:
        self.reads += 1
        if self.address is None or self.reads <= self.after:
            return None
        return KeyValue(key=key, value=self.address.encode(), mod_revision=1,
                        create_revision=1, lease=0)


def registry(address: str | None, after: int = 0) -> RunRegistry:
    return RunRegistry(_Published(address, after), "r")  # type: ignore[arg-type]


@pytest.mark.parametrize(("address", "endpoint"), [
    ("10.0.0.5:29500", ("10.0.0.5", 29500)),
    ("::1:29500", ("::1", 29500)),  # the port follows the last colon
])
def test_a_published_address_splits_at_its_last_colon(
        address: str, endpoint: tuple[str, int]) -> None:
    assert store_endpoint(address) == endpoint


def test_the_address_is_polled_until_its_host_publishes_it() -> None:
    slept: list[float] = []
    got = registry("h:1", after=3).await_store(2, timedelta(seconds=5), gone=lambda: False,
                                               sleep=slept.append, poll=0.05)
    assert got == ("h", 1) and slept == [0.05] * 3


def test_a_round_that_will_never_have_a_store_is_given_up_at_once() -> None:
    assert registry(None).await_store(2, timedelta(seconds=5), gone=lambda: True,
                                      sleep=lambda _: None, poll=0.05) is None


def test_no_address_in_time_is_a_rendezvous_timeout() -> None:
    with pytest.raises(RendezvousTimeoutError, match="no store address for round 2"):
        registry(None).await_store(2, timedelta(0), gone=lambda: False, sleep=lambda _: None,
                                   poll=0.05)


class _Flaky(_Published):
    """A cluster member restarting: the first ``failures`` reads raise, as etcd3 does."""

    def __init__(self, address: str, failures: int) -> None:
        super().__init__(address)
        self.failures = failures

    def get(self, key: str) -> KeyValue | None:
        if self.failures:
            self.failures -= 1
            raise StoreConnectionError(f"etcd failed on get {key}: leader changed")
        return super().get(key)


def test_a_read_that_etcd_fails_is_polled_again() -> None:
    # An agent and a worker waiting here while a cluster member restarted got "leader
    # changed" once; raised, it ended them (and the only copy of the state with one).
    flaky = RunRegistry(_Flaky("h:1", failures=2), "r")  # type: ignore[arg-type]
    assert flaky.await_store(2, timedelta(seconds=5), gone=lambda: False,
                             sleep=lambda _: None, poll=0.05) == ("h", 1)
    down = RunRegistry(_Flaky("h:1", failures=10**9), "r")  # type: ignore[arg-type]
    with pytest.raises(RendezvousTimeoutError):  # not forever
        down.await_store(2, timedelta(seconds=0.1), gone=lambda: False,
                         sleep=lambda _: None, poll=0.05)


def test_a_worker_reads_its_first_round_again_when_etcd_fails_a_read() -> None:
    round_ = Round(number=2, members=("a",), nprocs=(1,), hosts=("h",))
    reads: list[Round | Exception] = [StoreConnectionError("leader changed"), round_]

    def current_round() -> Round:
        value = reads.pop(0)
        if isinstance(value, Exception):
            raise value
        return value

    follower = RoundFollower.__new__(RoundFollower)
    follower.env = WorkerEnv(node_id="a", run_id="r", endpoint="e", round=2)
    follower.registry = types.SimpleNamespace(current_round=current_round)  # type: ignore
    follower._changed = threading.Event()
    assert follower.current() == round_


@pytest.mark.parametrize(("failures", "published"), [(2, True), (10**9, False)])
def test_the_host_publishes_its_store_again_when_etcd_fails_the_write(
        failures: int, published: bool) -> None:
    # A cluster member restarting reset the stream of the host's write: raised, it ended
    # the agent (the soak's n29). Not forever: past the wait, the loop decides again.
    round_ = Round(number=2, members=("a", "b"), nprocs=(1, 1), hosts=("h", "g"))
    writes: list[str] = []

    def publish_store(_: Round, address: str) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise StoreConnectionError("etcd failed on get_prefix: Stream removed")
        writes.append(address)

    def await_store(*_: object, **__: object) -> tuple[str, int]:
        return ("h", int(writes[-1].rsplit(":", 1)[1]))

    store = types.SimpleNamespace(publish_store=publish_store, await_store=await_store)
    got = agree_on_store(store, round_, NodeInfo("a", "127.0.0.1", 1),  # type: ignore[arg-type]
                         wait=timedelta(seconds=0.2), sleep=lambda _: None)
    assert (got is not None, len(writes)) == (published, int(published))
