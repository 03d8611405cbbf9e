"""The c10d store each round's process groups are created from.

Choice: a TCPStore re-hosted every round by that round's rank 0, at the address
its node's agent publishes in etcd under ``store/<k>``. Not an etcd-backed store:

- It survives any single node: round k+1's store lives on round k+1's first
  member, so the node that died cannot take it along; rounds never share one
  (each round's groups also use their own key prefix).
- It is fast: bootstrapping gloo makes O(world) store reads and writes. Measured
  by ``scripts/bench/pg_store.py`` on this machine (medians of 500): a TCPStore
  get takes 0.035 ms and a set 0.002 ms; etcd takes 0.45 ms to get and 0.94 ms
  to put (13x and ~600x slower), since every write goes through raft to disk,
  and a c10d ``wait`` on etcd would have to poll or hold a watch.
- It is what torchrun's env:// uses, so a torchrun script's rank 0 hosts it the
  same way in restart mode.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from elastic_rt.errors import NewerRound

CONNECT_ATTEMPT = timedelta(seconds=2)
"""One attempt to reach a round's store; between attempts a worker looks for a newer round."""

LISTEN_POLL_S = 0.005
"""Between two looks at whether the round's store host listens yet."""


def open_round_store(
    address: tuple[str, int], *, is_host: bool, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """Host (rank 0) or join the round's TCPStore at ``address``."""
    host, port = address
    return dist.TCPStore(
        host,
        port,
        world_size=world_size,
        is_master=is_host,
        timeout=timeout,
        wait_for_workers=False,
    )


def join_round_store(address: tuple[str, int], *, rank: int, world_size: int,
                     timeout: timedelta, newer_round: Callable[[], bool] | None) -> dist.Store:
    """Host (rank 0) or reach the round's store; give up if a newer round forms.

    A client retries its connection for the store's whole timeout. When the round's
    first node dies before hosting the store, one attempt of ``timeout`` would hold
    the survivors for minutes after the agents formed the next round, so clients
    connect in short attempts and ask ``newer_round()`` between them.

    Raises:
        NewerRound: ``newer_round()`` said so.
    """
    if rank == 0 or newer_round is None:
        return open_round_store(address, is_host=rank == 0, world_size=world_size,
                                timeout=timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            await_listener(address, CONNECT_ATTEMPT, newer_round=newer_round)
            store = open_round_store(address, is_host=False, world_size=world_size,
                                     timeout=CONNECT_ATTEMPT)
        except (RuntimeError, dist.DistError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            if newer_round():
                raise NewerRound() from None
            continue
        store.set_timeout(timeout)
        return store


def await_listener(address: tuple[str, int], within: timedelta,
                   newer_round: Callable[[], bool] | None = None) -> None:
    """Return as soon as something listens at ``address``; a refused connect is retried.

    Why not let the TCPStore client retry by itself: its connect backs off with jitter
    after a refusal, and the host of a new round is often a few milliseconds behind
    the others (it finishes a step, or learns of the round later). Measured on this
    machine: a client that arrived 50 ms before the host connected 0.2-0.6 s after the
    host was up; that wait was the 0.37-0.75 s tail of ``groups.reformed``. A plain
    connect every 5 ms finds the host within milliseconds, and the store client then
    connects on its first try. The probe connection is closed at once; the host's
    server drops it.

    Between two looks it asks ``newer_round()``: two rounds written moments apart (a
    peer's alarm round, then the one without a lost worker) can send the host straight
    to the second, and this round's store then never comes (that waited out a whole
    attempt, 2 s).

    Raises:
        TimeoutError: nothing listened within ``within``.
        NewerRound: ``newer_round()`` said so.
    """
    deadline = time.monotonic() + within.total_seconds()
    while True:
        try:
            socket.create_connection(address, timeout=within.total_seconds()).close()
            return
        except OSError as exc:  # refused (not up yet), reset, unreachable: look again
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens at {address[0]}:{address[1]}") from exc
            if newer_round is not None and newer_round():
                raise NewerRound() from None
            time.sleep(LISTEN_POLL_S)


def wait_for_ranks(store: dist.Store, prefix: str, *, world_size: int, timeout: timedelta,
                   newer_round: Callable[[], bool] | None) -> None:
    """Wait until every rank of the round has reached its store, however slow its start.

    A rank (re)started for this round (a joining node, a replaced worker, a fenced
    node back) first imports torch: seconds, more on a busy host. Bootstrapping the
    groups waits only the collective timeout, which is sized to catch a hung peer;
    with a slow starter the others would time out, raise the alarm, and a new round
    would restart the starter again: a livelock. This wait is bounded by ``timeout``
    and ends at once when a newer round forms (a starter that died on its way in
    loses its lease), so it never hangs.

    Raises:
        NewerRound: ``newer_round()`` said so.
    """
    key = f"{prefix}checked-in"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while arrived < world_size and time.monotonic() < deadline:
        if newer_round is not None and newer_round():
            raise NewerRound()
        time.sleep(0.01)  # poll the counter; the store has no blocking wait for a count
        arrived = store.add(key, 0)
