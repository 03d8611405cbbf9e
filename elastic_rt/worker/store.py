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

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

CONNECT_ATTEMPT = timedelta(seconds=2)
"""One attempt to reach a round's store; between attempts a worker looks for a newer round."""


class NewerRound(Exception):
    """A newer round formed while this one was being joined: join that one instead."""


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
            store = open_round_store(address, is_host=False, world_size=world_size,
                                     timeout=CONNECT_ATTEMPT)
        except (RuntimeError, dist.DistError):
            if time.monotonic() > deadline:
                raise
            if newer_round():
                raise NewerRound() from None
            continue
        store.set_timeout(timeout)
        return store


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
