"""Reaching a round's store: a worker that arrives before the round's host still joins.

The host (the round's rank 0) is often a moment behind the others; these tests run the
real TCPStore in this process and a client in a thread, the order a re-form sees.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_rt.etcd_server import free_port
from elastic_rt.errors import NewerRound
from elastic_rt.worker.round_store import await_listener, join_round_store

ADDRESS_HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=10)


def test_a_client_that_arrives_before_the_host_joins_once_the_host_is_up() -> None:
    address = (ADDRESS_HOST, free_port())
    joined: list[dist.Store] = []
    client = threading.Thread(target=lambda: joined.append(join_round_store(
        address, rank=1, world_size=2, timeout=TIMEOUT, newer_round=lambda: False)))
    client.start()
    time.sleep(0.1)  # the client is polling by now: the host comes second
    host = join_round_store(address, rank=0, world_size=2, timeout=TIMEOUT, newer_round=None)
    client.join(timeout=TIMEOUT.total_seconds())
    assert joined, "the client never reached the host's store"
    joined[0].set("from-client", "1")
    assert host.get("from-client") == b"1"


def test_waiting_for_a_listener_gives_up_after_its_deadline() -> None:
    address = (ADDRESS_HOST, free_port())  # nobody listens here
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="nothing listens"):
        await_listener(address, timedelta(seconds=0.3))
    assert time.monotonic() - began >= 0.3


def test_a_client_gives_up_on_a_round_whose_host_never_comes_once_a_newer_one_forms() -> None:
    address = (ADDRESS_HOST, free_port())  # the round's host went straight to a newer round
    asked = []

    def newer() -> bool:
        asked.append(time.monotonic())
        return len(asked) > 3  # a newer round forms while the client waits

    began = time.monotonic()
    with pytest.raises(NewerRound):
        join_round_store(address, rank=1, world_size=2, timeout=TIMEOUT, newer_round=newer)
    assert asked[-1] - began < 1.0, "the client waited out a whole connect attempt first"
