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

from datetime import timedelta

import torch.distributed as dist


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
