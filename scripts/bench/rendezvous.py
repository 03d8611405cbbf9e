"""Rendezvous at scale: N simulated nodes form one round, lose one, admit one; torch c10d beside.

elastic-rt's nodes run in a swarm (agents/swarm.py): every node is a coroutine with
its own lease, key and keep-alive that runs the agent's own code path (it follows the
run through agents/run_watch.py and decides with agents/policy.py, as
agents/agent.py does), and its etcd calls go through a few shared clients, so 1024
nodes fit on two cores. Each phase is timed from its event (all nodes start; one
node's lease is revoked, as an agent evicts a peer whose liveness socket refuses;
one node starts) to every node holding the new round. Operations are the calls the
nodes send (by kind; watch events pushed by etcd apart), retries are calls etcd
failed and proposals that lost the compare, and etcd's request rate comes from its
own /metrics. The run fails (exit 2) when the harness was the bottleneck.

torch: every node is a thread with a TCPStore client and a DynamicRendezvousHandler
over the c10d backend, counted at its store calls (not counted: the 2 calls per node
that share the bootstrap store address after the round). It runs up to
``--torch-max`` nodes, each with ``--torch-timeout``; a timeout is reported as how far
it got.

Run:  python scripts/bench/rendezvous.py [--nodes 8 32 128 256 1024] [--torch-max 128]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from agents.swarm_run import HarnessBound, SwarmReport, run_swarm

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.testing import OpCounter


@dataclass(frozen=True)
class TorchTrial:
    seconds: float
    ops: int
    joined: int
    """Nodes that held the round when the clock stopped (all of them unless it timed out)."""


class _CountingBackend(C10dRendezvousBackend):
    """torch's c10d backend, counting the store calls it makes."""

    def __init__(self, store: dist.Store, run_id: str, counter: OpCounter) -> None:
        self._counter = counter
        super().__init__(store, run_id)

    def _call_store(self, store_op: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._counter.add(store_op)
        return super()._call_store(store_op, *args, **kwargs)


def torch_c10d_round(server: dist.TCPStore, n_nodes: int, timeout: float) -> TorchTrial:
    """Time torch's rendezvous of ``n_nodes`` threads; on timeout, how many got through."""
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
    lock, joined, all_in = threading.Lock(), [0], threading.Event()

    def join(handler: DynamicRendezvousHandler) -> None:
        try:
            handler.next_rendezvous()
        except BaseException:  # noqa: BLE001 - thread boundary: a timeout shows in `joined`
            return
        with lock:
            joined[0] += 1
            if joined[0] == n_nodes:
                all_in.set()

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    all_in.wait(timeout)
    seconds = time.monotonic() - began
    for handler in handlers:
        handler._stop_heartbeats()  # no public way to stop them without closing the run
    return TorchTrial(seconds, counter.total(), joined[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--clients", type=int, default=16, help="shared etcd channels")
    parser.add_argument("--workers", type=int, default=64, help="threads for blocking calls")
    parser.add_argument("--torch-max", type=int, default=128)
    parser.add_argument("--torch-timeout", type=float, default=60.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    print(f"load average before: {_load()}", flush=True)
    reports: dict[tuple[str, int], SwarmReport] = {}
    torch_trials: dict[int, TorchTrial] = {}
    with EtcdServer() as etcd:
        for n in args.nodes:
            report = asyncio.run(run_swarm(etcd.endpoint, n, clients=args.clients,
                                           workers=args.workers))
            reports[("agent", n)] = report
            _print_details(f"agent n={n}", report)
            print(f"load average: {_load()}", flush=True)
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
        for n in (n for n in args.nodes if n <= args.torch_max):
            torch_trials[n] = torch_c10d_round(server, n, args.torch_timeout)
    _print_table(reports, torch_trials)
    bound = [f"{key}: {r.load.verdict()}" for key, r in reports.items() if r.load.verdict()]
    if bound:
        print(f"HARNESS-BOUND, figures not etcd's: {bound}", file=sys.stderr)
        raise SystemExit(2)


def _print_details(label: str, report: SwarmReport) -> None:
    for phase in report.phases:
        ops = {k: v for k, v in sorted(phase.ops.items())}
        print(f"{label:<16} {phase.name:<7} {phase.seconds:6.2f} s  ops {ops}  retries "
              f"{phase.retries}  etcd {phase.etcd_rate:.0f} req/s {_int(phase.etcd)}  "
              + " ".join(f"{k} {v:.2f} s" for k, v in phase.milestones.items()))
    print(f"{label:<16} keep-alives {report.lease_refresh_per_s:.0f}/s; "
          f"{report.load.summary()}", flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _int(counts: dict[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in sorted(counts.items())}


def _print_table(reports: dict[tuple[str, int], SwarmReport],
                 torch_trials: dict[int, TorchTrial]) -> None:
    header = (f"{'protocol':>8} {'nodes':>5} | {'form s':>6} {'ops/n':>5} {'retry':>5} | "
              f"{'lose1 s':>7} {'ops/n':>5} | {'grow1 s':>7} {'ops/n':>5} | "
              f"{'etcd/s':>6} {'k-a/s':>5} | "
              f"{'torch s':>7} {'ops/n':>5} {'joined':>6}")
    print("\n" + header + "\n" + "-" * len(header))
    for (name, n), report in reports.items():
        form, *events = report.phases
        line = (f"{name:>8} {n:>5} | {form.seconds:>6.2f} {form.per_node():>5.2f} "
                f"{sum(form.retries.values()):>5}")
        for phase in events:
            line += f" | {phase.seconds:>7.2f} {phase.per_node():>5.2f}"
        line += f" | {form.etcd_rate:>6.0f} {report.lease_refresh_per_s:>5.0f} | "
        ref = torch_trials.get(n)
        line += (f"{ref.seconds:>7.2f} {ref.ops / n:>5.1f} {ref.joined:>4}/{n}" if ref
                 else f"{'-':>7} {'-':>5} {'-':>6}")
        print(line)
    print("ops/n: etcd calls per node in the phase (keep-alives and watch events apart); "
          "k-a/s: keep-alives per second in the formed round")
    print("targets: form 128 <= 1.0 s, 256 <= 1.5 s, 1024 <= 3 s; <= 3 ops/node flat; "
          "lose 1 at 1024 <= 2 s")


if __name__ == "__main__":
    try:
        main()
    except HarnessBound as exc:
        raise SystemExit(f"HARNESS-BOUND: {exc}") from exc
