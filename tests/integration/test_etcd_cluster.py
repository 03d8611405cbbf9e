"""A three-member etcd cluster: clients given every member survive losing one.

The members are real etcd processes on 127.0.0.1 (``etcd_cluster`` fixture). The
client is told all three (``host:port,host:port,host:port``, as ``--rdzv-endpoint
etcd://h1:2379,h2:2379,h3:2379`` passes them); killing the member it talks to must
cost a failed call at most, never the run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from elastic_rt.cli.flags import parse_endpoint
from elastic_rt.errors import ConfigError, StoreConnectionError, StoreError
from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.harness.waits import WaitTimeout
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import Get, Put
from tests.fixtures.etcd import put_and_see
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(240)]

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")


def _endpoints(members: list[EtcdServer]) -> str:
    return ",".join(m.endpoint for m in members)


def _in_use(kv: EtcdKV, members: list[EtcdServer]) -> EtcdServer:
    netloc = kv._client.endpoint_in_use.netloc
    return next(m for m in members if m.endpoint == netloc)


def _retrying(call, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    """What a caller does across a member's loss: try again until it works."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the next call goes to another member


def test_a_cluster_endpoint_list_parses_and_a_bad_member_is_named() -> None:
    assert parse_endpoint("etcd://10.0.0.1:2379,10.0.0.2:2379") == (
        "10.0.0.1:2379,10.0.0.2:2379", False)
    assert parse_endpoint("etcds://a:1, b:2")[1] is True
    with pytest.raises(ConfigError, match="not host:port"):
        parse_endpoint("etcd://10.0.0.1:2379,10.0.0.2")


def test_a_client_survives_the_loss_of_the_member_it_uses(
        etcd_cluster: list[EtcdServer]) -> None:
    kv = EtcdKV(_endpoints(etcd_cluster))
    changed = threading.Event()
    try:
        kv.put("/cluster/x", b"1")
        lease = kv.grant_lease(10)
        kv.put("/cluster/leased", b"1", lease=lease)
        cancel = kv.on_change("/cluster/x", changed.set)
        victim = _in_use(kv, etcd_cluster)
        victim.kill()

        _retrying(lambda: kv.put("/cluster/x", b"2"))
        assert _in_use(kv, etcd_cluster) is not victim
        assert kv.get("/cluster/x").value == b"2"  # type: ignore[union-attr]
        assert _retrying(lambda: kv.refresh_lease(lease)) is True
        assert kv.get("/cluster/leased") is not None  # the lease is the cluster's

        changed.clear()
        deadline = time.monotonic() + 10
        while not changed.is_set() and time.monotonic() < deadline:
            kv.put("/cluster/x", b"3")  # the watch re-arms on a live member
            changed.wait(0.5)
        assert changed.is_set(), "the watch went silent after the member died"
        cancel()
    finally:
        kv.close()


def test_transactions_and_batched_keep_alives_fail_over_like_the_other_calls(
        etcd_cluster: list[EtcdServer]) -> None:
    # Both call etcd's stubs directly (the rendezvous joins and claims the leadership
    # in one transaction); a member that stops answering must be benched for them too.
    kv, keeper = EtcdKV(_endpoints(etcd_cluster)), EtcdKV(_endpoints(etcd_cluster))
    try:
        lease = kv.grant_lease(10)
        victim = _in_use(kv, etcd_cluster)
        keeper._client._current_endpoint_label = victim.endpoint  # both on the victim
        victim.kill()

        result = _retrying(lambda: kv.txn({"/cluster/t": 0},
                                          [Put("/cluster/t", b"1"), Get("/cluster/t")]))
        assert _in_use(kv, etcd_cluster) is not victim
        assert result.succeeded and result.reads[0][0].value == b"1"
        assert _retrying(lambda: keeper.refresh_leases([lease])) == [True]
        assert _in_use(keeper, etcd_cluster) is not victim
    finally:
        kv.close()
        keeper.close()


def test_a_slow_call_that_moves_the_client_ends_the_watch_stream_on_the_member_it_left(
        etcd_cluster: list[EtcdServer]) -> None:
    # The member lives on: etcd would serve the dropped watcher's half-closed stream, and
    # python3-etcd3 keep its thread, until that connection ends, while a watch armed after
    # opens another: one more of each for every slow call. The watch armed before moves
    # with the client.
    kv = EtcdKV(_endpoints(etcd_cluster), timeout=1)
    leader = kv._client.status().leader.name
    followers = [m for m in etcd_cluster if m.name != leader]
    kv._client._current_endpoint_label = followers[0].endpoint  # a stopped leader stops all
    watchers: list[Any] = []  # every watcher the client made (other tests' threads aside)

    def seen(fired: threading.Event, what: str) -> None:
        wait_until(lambda: put_and_see(kv, fired, "/moves/k"), 20, what)
        watchers.append(kv._client._stubs.get("watcher"))

    def streaming() -> int:
        return sum(t.is_alive() for t in {w._callback_thread for w in watchers if w} if t)

    def slow_call_on(victim: EtcdServer) -> bool:
        """Whether a read timed out on ``victim``, stopped, with the client and its watch
        moved there (a put fired the watch) first. False when the read went elsewhere: a
        put that timed out on a slow machine moves the client, and the watch re-arming on
        its own thread may take a member of its choosing while the label is set here."""
        if kv._client.endpoints[victim.endpoint].is_failed():
            return False  # a benched member is passed over: wait for its bench to end
        kv._client._current_endpoint_label = victim.endpoint
        seen(fired, "the watch on the victim")
        if _in_use(kv, etcd_cluster) is not victim:
            return False
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            kv.get("/moves/k")
            return False
        except StoreConnectionError:
            return True  # the next call goes elsewhere
        finally:
            os.kill(victim.pid, signal.SIGCONT)

    fired = threading.Event()
    cancel = kv.on_change("/moves/", fired.set)
    try:
        seen(fired, "the watch to fire")
        for victim in (*followers, followers[0]):
            wait_until(lambda: slow_call_on(victim), 60, "a read timed out on the victim")
            seen(fired, "the watch to move")
            assert _in_use(kv, etcd_cluster) is not victim
            again = threading.Event()  # as a round's watch is armed after a failure
            cancel_again = kv.on_change("/moves/", again.set)
            seen(again, "the new watch to fire")
            cancel_again()
        wait_until(lambda: streaming() <= 1, 10, "the dropped watchers' streams to end")
    finally:
        cancel()
        kv.close()


@pytest.mark.slow
def test_an_in_process_job_trains_through_the_loss_of_an_etcd_member(
        process_tree: ProcessTree, etcd_cluster: list[EtcdServer], run_id: str,
        tmp_path: Path) -> None:
    endpoints = _endpoints(etcd_cluster)
    steps = 60
    agents = {}
    for name in "ab":
        args = launch_args(endpoints, run_id, "2", tmp_path / "events.jsonl", node_id=name)
        script = [SCRIPT, "--steps", str(steps), "--out", str(tmp_path / "out.pt"),
                  "--step-time", "0.05"]
        agents[name] = process_tree.elastic_rt(*args, *script, env=child_env(),
                                               log=str(tmp_path / f"{name}.log"))

    def step() -> int:
        return max((e.step or 0 for e in events(tmp_path / "events.jsonl")
                    if e.name == "step.completed"), default=0)

    wait_until(lambda: step() >= 15, 180, "step 15")
    etcd_cluster[0].kill()
    for name, proc in agents.items():
        assert proc.wait(timeout=180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    log = events(tmp_path / "events.jsonl")
    done = sorted(e.step for e in log
                  if e.name == "step.completed" and e.rank == 0 and e.step is not None)
    assert done == list(range(1, steps + 1)), "a step was skipped or done twice"
    assert not [e for e in log if e.name in ("worker.restarted", "agent.fenced")]


@pytest.mark.parametrize("stopped", ["follower-in-use", "leader"])
def test_a_short_lease_lives_through_a_member_that_takes_calls_but_does_not_answer(
        etcd_cluster: list[EtcdServer], stopped: str) -> None:
    # A stopped member keeps its port open: a renewal sent to it hangs, as on a member
    # restarting and not yet back in its cluster. At the client's 5 s default one such
    # renewal outlived the 3 s lease of a node that was training (docs/soak.md, finding
    # 14); the keeper's renewals give up after a sixth of the TTL and go to another member.
    # A stopped leader: the others elect a new one, and meanwhile hold each renewal; a
    # renewal after a failure waits for them (short ones would bench every member).
    from elastic_rt.rendezvous.lease import LeaseKeeper
    from elastic_rt.rendezvous.registry import RunRegistry
    from elastic_rt.rendezvous.rounds import NodeInfo

    kv, reader = EtcdKV(_endpoints(etcd_cluster)), EtcdKV(_endpoints(etcd_cluster))
    leader = kv._client.status().leader.name
    followers = [m for m in etcd_cluster if m.name != leader]
    victim = (followers[0] if stopped == "follower-in-use"
              else next(m for m in etcd_cluster if m.name == leader))
    kv._client._current_endpoint_label = followers[0].endpoint
    reader._client._current_endpoint_label = followers[1].endpoint
    fenced: list[str] = []
    registry = RunRegistry(kv, "finding-14")
    keeper = LeaseKeeper(registry, NodeInfo("n7", "127.0.0.1", 1), timedelta(seconds=3),
                         on_fenced=fenced.append,
                         register=lambda lease: registry.register(keeper.info, lease))
    keeper.start()
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        # twice the lease's life with the member silent
        with pytest.raises(WaitTimeout):
            wait_until(lambda: fenced or None, 6.0, "the keeper to fence itself")
        assert _retrying(lambda: RunRegistry(reader, "finding-14").node("n7")) is not None
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        keeper.stop()
        kv.close()
        reader.close()
