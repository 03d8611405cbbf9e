"""Why the process-group store is a re-hosted TCPStore and not etcd: measured here.

Bootstrapping gloo makes O(world) store writes and reads (addresses, barriers).
This times the same set/get round trips against a TCPStore on 127.0.0.1 and
against etcd (an embedded server, through our EtcdKV), side by side.
Run: python scripts/bench/pg_store.py
"""

from __future__ import annotations

import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from elastic_rt.etcd_server import EtcdServer, free_port  # noqa: E402
from elastic_rt.rendezvous.etcd_kv import EtcdKV  # noqa: E402

ROUNDS = 500


def timed(fn, n: int = ROUNDS) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for i in range(n):
        began = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e3


def main() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    tcp_set = timed(lambda i: client.set(f"k{i}", "x" * 64))
    tcp_get = timed(lambda i: client.get(f"k{i}"))
    with EtcdServer() as server:
        kv = EtcdKV(server.endpoint)
        etcd_put = timed(lambda i: kv.put(f"/bench/k{i}", b"x" * 64))
        etcd_get = timed(lambda i: kv.get(f"/bench/k{i}"))
        kv.close()
    del store
    print(f"{'operation':10s} {'TCPStore ms':>12s} {'etcd ms':>10s} {'ratio':>7s}")
    print(f"{'set/put':10s} {tcp_set:12.3f} {etcd_put:10.3f} {etcd_put / tcp_set:7.1f}x")
    print(f"{'get':10s} {tcp_get:12.3f} {etcd_get:10.3f} {etcd_get / tcp_get:7.1f}x")


if __name__ == "__main__":
    main()
