"""Rendezvous at scale: N simulated nodes form one round, elastic-rt beside torch c10d.

Every node is a thread with its own client (elastic-rt: an etcd client, a lease
keeper and the agent's decide loop; torch: a TCPStore client and a
``DynamicRendezvousHandler`` over the ``c10d`` backend). The clock starts when all
clients are connected and stops when every node holds the round. Operations are the
calls each node sends to its store in that window, counted by a wrapper:

- elastic-rt: every :class:`~elastic_rt.rendezvous.kv.KVStore` call (reads, writes,
  leases, watch set-up); watch events pushed by etcd are shown apart.
- torch: every ``get``/``compare_set`` its c10d backend sends for the rendezvous
  state. Not counted: the 2 calls per node that share the bootstrap store address
  after the round (``RendezvousStoreInfo``).

Both elastic-rt loops run the agent's own decisions (agents/policy.py, through
agents/simulated.py) and differ in when they wake. ``agent`` is what agents/agent.py does (wake
only on writes that change a decision — for forming a round, the round key — and
re-read at most once a second while in a round); ``any-write`` is the first
design, kept for comparison (wake on any write under the run's prefix, a full
snapshot every 0.1 s in a round), which was O(N^2) reads per round.

Run:  python scripts/bench/rendezvous.py [--nodes 32 64 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from agents.simulated import form_round
from elastic_rt.etcd_server import EtcdServer
from elastic_rt.testing import OpCounter

LOOPS: dict[str, dict[str, Any]] = {
    "agent": {"wake_on": "round", "member_poll": 1.0},
    "any-write": {},
}


@dataclass(frozen=True)
class Trial:
    seconds: float
    ops: int
    detail: dict[str, int]


class _CountingBackend(C10dRendezvousBackend):
    """torch's c10d backend, counting the store calls it makes."""

    def __init__(self, store: dist.Store, run_id: str, counter: OpCounter) -> None:
        self._counter = counter
        super().__init__(store, run_id)

    def _call_store(self, store_op: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._counter.add(store_op)
        return super()._call_store(store_op, *args, **kwargs)


def torch_c10d_round(server: dist.TCPStore, n_nodes: int, timeout: float = 120.0) -> Trial:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    counter = OpCounter()
    handlers = []
    for _ in range(n_nodes):
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
        backend = _CountingBackend(store, run_id, counter)
        handlers.append(
            DynamicRendezvousHandler.from_backend(
                run_id, store, backend, min_nodes=n_nodes, max_nodes=n_nodes,
                local_addr="127.0.0.1", timeout=RendezvousTimeout(join=timedelta(seconds=timeout)),
            )
        )  # fmt: skip
    counter.reset()
    done = threading.Barrier(n_nodes + 1, timeout=timeout)
    errors: list[BaseException] = []

    def join(handler: DynamicRendezvousHandler) -> None:
        try:
            handler.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - thread boundary: report below
            errors.append(exc)
        done.wait()

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    done.wait()
    seconds = time.monotonic() - began
    detail = counter.snapshot()
    if errors:
        raise RuntimeError(f"torch rendezvous failed: {errors[0]!r}") from errors[0]
    for handler in handlers:
        handler._stop_heartbeats()  # no public way to stop them without closing the run
    return Trial(seconds, sum(detail.values()), detail)


def elastic_rt_round(endpoint: str, n_nodes: int, loop: str) -> Trial:
    result = form_round(endpoint, f"bench-{uuid.uuid4().hex[:8]}", n_nodes, **LOOPS[loop])
    tokens = {r.token for r in result.rounds.values()}
    if len(tokens) != 1:
        raise RuntimeError(f"nodes disagree on the round: tokens {tokens}")
    return Trial(result.seconds, result.total_ops, result.ops)


def median_trial(trials: list[Trial]) -> Trial:
    ordered = sorted(trials, key=lambda t: t.seconds)
    return ordered[len(ordered) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loops", nargs="+", default=list(LOOPS), choices=list(LOOPS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    results: dict[tuple[str, int], list[Trial]] = {}
    with EtcdServer() as etcd:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
        for n in args.nodes:
            for _ in range(args.repeats):
                for loop in args.loops:
                    trial = elastic_rt_round(etcd.endpoint, n, loop)
                    results.setdefault((loop, n), []).append(trial)
                results.setdefault(("torch-c10d", n), []).append(torch_c10d_round(server, n))
            _print_row_details(results, n, args.loops)
    _print_table(results, args.nodes, args.loops, args.repeats)


def _print_row_details(
    results: dict[tuple[str, int], list[Trial]], n: int, loops: list[str]
) -> None:
    for system in [*loops, "torch-c10d"]:
        trials = results[(system, n)]
        times = " ".join(f"{t.seconds:.2f}" for t in trials)
        detail = median_trial(trials).detail
        print(f"n={n:<4} {system:<10} seconds: {times:<20} ops of median: {detail}")


def _print_table(results: dict[tuple[str, int], list[Trial]], nodes: list[int], loops: list[str],
                 repeats: int) -> None:
    print(f"\nmedian of {repeats} rounds per cell; ratio = elastic-rt / torch c10d")
    header = f"{'nodes':>5} | {'torch s':>8} {'ops':>6} {'ops/node':>8}"
    for loop in loops:
        header += f" | {loop + ' s':>11} {'ops':>6} {'ops/node':>8} {'t ratio':>7} {'op ratio':>8}"
    print(header)
    print("-" * len(header))
    for n in nodes:
        ref = median_trial(results[("torch-c10d", n)])
        line = f"{n:>5} | {ref.seconds:>8.2f} {ref.ops:>6} {ref.ops / n:>8.1f}"
        for loop in loops:
            ours = median_trial(results[(loop, n)])
            line += (f" | {ours.seconds:>11.2f} {ours.ops:>6} {ours.ops / n:>8.1f}"
                     f" {ours.seconds / ref.seconds:>7.2f} {ours.ops / max(ref.ops, 1):>8.2f}")
        print(line)
    print("ops/node flat as nodes grow = linear; target: 128 nodes <= 3 s")


if __name__ == "__main__":
    main()
