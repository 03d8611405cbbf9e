"""Heartbeats against real etcd and real sockets: silent peers go, answering ones stay.

A SIGSTOPped agent's kernel still accepts connections on its liveness port but nobody
answers; a listening socket that is never accepted from behaves the same, without
stopping a process. A refused port is an agent that is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest

from agents.alive import AliveServer
from agents.heartbeat import Heartbeat
from elastic_rt.config import HeartbeatConfig
from elastic_rt.etcd_server import EtcdServer
from elastic_rt.events import EventSink
from elastic_rt.harness import wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import NodeInfo, Round
from tests.integration.launch_helpers import events

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

CONFIG = HeartbeatConfig(interval=timedelta(seconds=0.05), misses=4)
ROUND = Round(number=1, members=("a", "b"), nprocs=(1, 1), hosts=("127.0.0.1", "127.0.0.1"))


@pytest.fixture()
def registry(etcd_server, run_id: str) -> Iterator[RunRegistry]:
    kv = EtcdKV(etcd_server.endpoint)
    yield RunRegistry(kv, run_id)
    kv.close()


def _register_b(registry: RunRegistry, alive_addr: str) -> None:
    lease = registry.kv.grant_lease(30)  # the lease would keep b for 30 s
    registry.register(NodeInfo(node_id="b", host="127.0.0.1", nproc=1, alive_addr=alive_addr),
                      lease)


def _watch_from_a(registry: RunRegistry, tmp_path: Path) -> tuple[Heartbeat, threading.Event]:
    evicted = threading.Event()
    sink = EventSink(str(tmp_path / "events.jsonl"), source="agent", run_id=registry.run_id,
                     node="a")
    heartbeat = Heartbeat(registry, "a", CONFIG, sink, on_evicted=evicted.set)
    heartbeat.start()
    heartbeat.watch(ROUND)
    return heartbeat, evicted


def test_a_peer_that_accepts_but_never_answers_is_evicted_after_the_window(
    registry: RunRegistry, tmp_path: Path
) -> None:
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # the kernel completes the handshake; nobody ever answers
    try:
        _register_b(registry, f"127.0.0.1:{hung.getsockname()[1]}")
        began = time.monotonic()
        heartbeat, evicted = _watch_from_a(registry, tmp_path)
        try:
            assert evicted.wait(10), "the silent peer was not evicted"
            took = time.monotonic() - began
        finally:
            heartbeat.stop()
    finally:
        hung.close()
    assert took >= CONFIG.window_s
    assert registry.node("b") is None  # its lease was revoked with its registration
    [event] = [e for e in events(tmp_path / "events.jsonl") if e.name == "node.evicted"]
    assert event.metadata["evicted"] == "b" and event.metadata["liveness"] == "unknown"


def test_a_peer_whose_port_refuses_is_evicted_at_once(registry: RunRegistry,
                                                      tmp_path: Path) -> None:
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()  # nothing listens there any more
    _register_b(registry, address)
    heartbeat, evicted = _watch_from_a(registry, tmp_path)
    try:
        assert evicted.wait(10)
    finally:
        heartbeat.stop()
    assert registry.node("b") is None


def test_a_peer_that_answers_stays_and_one_that_left_is_not_evicted(
    registry: RunRegistry, tmp_path: Path
) -> None:
    alive = AliveServer()
    try:
        _register_b(registry, alive.address)
        heartbeat, evicted = _watch_from_a(registry, tmp_path)
        try:
            # many windows of answered probes
            assert not evicted.wait(CONFIG.window_s * 5)
            assert registry.node("b") is not None
            # b leaves gracefully: its registration goes first, then its port closes
            info = registry.node("b")
            assert info is not None
            registry.evict(info)
            alive.close()
            assert not evicted.wait(CONFIG.window_s * 3)
        finally:
            heartbeat.stop()
    finally:
        alive.close()
    assert [e for e in events(tmp_path / "events.jsonl") if e.name == "node.evicted"] == []


def test_a_watcher_whose_round_is_gone_evicts_nobody(registry: RunRegistry,
                                                     tmp_path: Path) -> None:
    # a was cut off: its probes of b failed, and meanwhile the others formed round 2
    # without a. Its silence was its own; b, healthy, must stay.
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()  # b looks dead from a: its port refuses
    _register_b(registry, address)
    newer = Round(number=2, members=("b", "c"), nprocs=(1, 1), hosts=("127.0.0.1",) * 2)
    registry.kv.put(registry.key("round"), newer.to_json())
    heartbeat, evicted = _watch_from_a(registry, tmp_path)
    try:
        assert not evicted.wait(CONFIG.window_s * 5)
    finally:
        heartbeat.stop()
    assert registry.node("b") is not None


def test_a_watcher_cut_off_for_a_moment_keeps_a_peer_that_answers_once_it_is_back(
    fresh_etcd: EtcdServer, run_id: str, tmp_path: Path
) -> None:
    """A cut-off watcher hears nothing from its peer *and* cannot reach etcd; the others have
    not yet formed a round without it when its link comes back. Here etcd is SIGSTOPped while
    b's port stays silent past the window (a's eviction then waits on its etcd reads), and b
    answers again before etcd does: b, healthy all along, must stay. (Before the last probe
    was added, a evicted b here; a soak lost its state that way.)"""
    kv = EtcdKV(fresh_etcd.endpoint)
    registry = RunRegistry(kv, run_id)
    hung = socket.socket()
    hung.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # silent: the kernel accepts, nobody answers
    port = hung.getsockname()[1]
    answering: list[AliveServer] = []
    answering_never: list[socket.socket] = []
    try:
        _register_b(registry, f"127.0.0.1:{port}")
        heartbeat, evicted = _watch_from_a(registry, tmp_path)
        try:
            hung.settimeout(0.05)  # a's first probe arrives once a read b's registration
            probe, _ = wait_until(lambda: _accepted(hung), 10, "a's first probe of b")
            answering_never.append(probe)  # held open, unanswered (closed, it reads as dead)
            assert fresh_etcd.pid is not None
            os.kill(fresh_etcd.pid, signal.SIGSTOP)  # a's link "cut": etcd unreachable
            try:  # the cut lasts three windows: a's eviction waits on etcd
                time.sleep(CONFIG.window_s * 3)
                hung.close()  # the link is back: b answers on the same port
                answering.append(AliveServer(port=port))
            finally:
                os.kill(fresh_etcd.pid, signal.SIGCONT)
            assert not evicted.wait(CONFIG.window_s * 5), "a evicted b, which answered"
        finally:
            heartbeat.stop()
        assert registry.node("b") is not None
    finally:
        hung.close()
        for server in answering:
            server.close()
        for conn in answering_never:
            conn.close()
        kv.close()


def _accepted(server: socket.socket) -> tuple[socket.socket, object] | None:
    try:
        return server.accept()
    except (socket.timeout, BlockingIOError):
        return None
