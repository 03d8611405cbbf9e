"""Why the process-group store is a re-hosted TCPStore and not etcd: measured here.

Bootstrapping gloo makes O(world) store writes and reads (addresses, barriers).
This times the same set/get round trips against a TCPStore on 127.0.0.1 and
against etcd (an embedded server, through our EtcdKV), side by side.
It also times a client that reaches a round's store 50 ms before its host starts
(a re-form's usual order): TCPStore's own connect retry, which backs off after a
refusal, against waiting for the host's listener first (``worker/round_store.py``).
Run: python scripts/bench/pg_store.py
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from elastic_rt.etcd_server import EtcdServer, free_port  # noqa: E402
from elastic_rt.rendezvous.etcd_kv import EtcdKV  # noqa: E402
from elastic_rt.worker.round_store import await_listener  # noqa: E402

ROUNDS = 500
LATE_HOST_S = 0.05
LATE_TRIALS = 10


def timed(fn, n: int = ROUNDS) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for i in range(n):
        began = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e3


def late_host(wait_first: bool) -> float:
    """Median ms from the host's start until a client that arrived first is connected."""
    samples = []
    for _ in range(LATE_TRIALS):
        port, connected = free_port(), []

        def client() -> None:
            if wait_first:
                await_listener(("127.0.0.1", port), timedelta(seconds=10))
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
            connected.append(time.perf_counter())

        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(LATE_HOST_S)
        up = time.perf_counter()
        host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=10))
        thread.join()
        samples.append((connected[0] - up) * 1e3)
        del host
    return statistics.median(samples)


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
    retry, waited = late_host(wait_first=False), late_host(wait_first=True)
    print(f"\nclient arrives {LATE_HOST_S * 1e3:.0f} ms before the host, ms from the host's "
          f"start to connected (median of {LATE_TRIALS}; load average {os.getloadavg()[0]:.1f}):")
    print(f"  TCPStore's own retry {retry:8.1f}")
    print(f"  listener awaited     {waited:8.1f}   ({retry / max(waited, 1e-3):.0f}x less)")


if __name__ == "__main__":
    main()
