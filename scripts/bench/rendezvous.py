"""Rendezvous at scale: N simulated nodes form one round, lose one, admit one; torch c10d beside.

elastic-rt's nodes run in a swarm (agents/sim/swarm.py): every node is a coroutine with
its own lease, key and keep-alive that runs the agent's own code path (it follows the
run through agents/run_copy.py, sends the registry's requests and decides with
agents/policy/ through agents/dispatch.py, as agents/agent.py does), and its etcd calls
go out over a few shared grpc.aio channels from the event loop of each of ``--processes`` slices
(agents/sim/swarm_slice.py), so 1024 nodes fit on two cores. Each phase is timed from
its event (all nodes start; one node's lease is revoked, as an agent evicts a peer
whose liveness socket refuses; one node starts) to every node holding the new round.
Operations are the calls the nodes send (by kind; watch events pushed by etcd apart),
retries are calls etcd failed and proposals that lost the compare, etcd's request
rate comes from its own /metrics and its CPU from its threads.

Every target is judged from the figures. A run where the harness may have set the pace (a
late event loop, a slice at its GIL's limit, or the harness and etcd together saturating the
machine) says so loudly: its figures are upper bounds, since the harness can only add time
(it takes CPU from etcd; it never answers for it). So a target such a run meets is met, and
one it misses cannot be judged. Exit 0: every target met; 1: a target missed by a run that
was not harness-bound; 2: a target missed by a harness-bound run.

torch: every node is a thread with a TCPStore client and a DynamicRendezvousHandler
over the c10d backend, counted at its store calls (scripts/bench/_torch_c10d.py), each
trial in a process of its own that is killed if it does not answer. It runs up to
``--torch-max`` nodes, each with ``--torch-timeout``; a timeout is reported as how far
it got, and the larger sizes are then skipped.

Run:  python scripts/bench/rendezvous.py [--nodes 8 32 128 256 1024] [--torch-max 128]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from agents.sim.swarm_run import HarnessBound, SwarmReport, run_swarm
from elastic_rt.etcd_server import EtcdServer

if TYPE_CHECKING:
    from _torch_c10d import TorchTrial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--processes", type=int, default=2,
                        help="swarm slices, each a process with its own event loop and channels")
    parser.add_argument("--clients", type=int, default=32,
                        help="shared etcd channels per slice")
    parser.add_argument("--torch-max", type=int, default=128)
    parser.add_argument("--torch-timeout", type=float, default=60.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    print(f"load average before: {_load()}", flush=True)
    reports: dict[tuple[str, int], SwarmReport] = {}
    torch_trials: dict[int, TorchTrial] = {}
    with EtcdServer() as etcd:
        for n in args.nodes:
            report = run_swarm(etcd.endpoint, n, processes=args.processes,
                               clients=args.clients, etcd_pid=etcd.pid)
            reports[("agent", n)] = report
            _print_details(f"agent n={n}", report)
            print(f"load average: {_load()}", flush=True)
    if any(n <= args.torch_max for n in args.nodes):
        from _torch_c10d import torch_c10d_round  # torch only when asked (slices never need it)

        for n in (n for n in args.nodes if n <= args.torch_max):
            torch_trials[n] = trial = torch_c10d_round(n, args.torch_timeout)
            print(f"torch c10d n={n}: {trial}; load average: {_load()}", flush=True)
            if trial.joined < n:  # larger ones would not finish either
                break
    _print_table(reports, torch_trials)
    raise SystemExit(_judge(reports))


FORM_TARGET_S = {128: 1.0, 256: 1.5, 1024: 3.0}
LOSE_TARGET_S = {1024: 2.0}
CALLS_PER_NODE = 3.0
"""Per node and round; the round's own one write (by the leader) comes on top: 3 + 1/N."""


def _judge(reports: dict[tuple[str, int], SwarmReport]) -> int:
    """Print each target's outcome and the harness's verdict; the exit status (see above)."""
    missed, bound = [], []
    for (_, n), report in reports.items():
        form, lose = report.phases[0], report.phases[1]
        checks = [(f"form {n} <= {FORM_TARGET_S[n]} s", form.seconds <= FORM_TARGET_S[n], True)
                  ] if n in FORM_TARGET_S else []
        if n in LOSE_TARGET_S:
            checks.append((f"lose 1 at {n} <= {LOSE_TARGET_S[n]} s",
                           lose.seconds <= LOSE_TARGET_S[n], True))
        checks.append((f"calls per node at {n} <= {CALLS_PER_NODE:g} (+1/N)",
                       form.per_node() <= CALLS_PER_NODE + 1 / n + 1e-9, False))
        verdict = report.load.verdict()
        if verdict:
            bound.append(n)
            print(f"HARNESS-BOUND at {n} nodes: {verdict}; its figures are upper bounds",
                  file=sys.stderr)
        for name, met, timed in checks:
            print(f"target {name}: {'met' if met else 'MISSED'}"
                  + (" (by an upper bound)" if met and timed and verdict else ""))
            if not met:
                missed.append((n, name, timed))
    if not missed:
        return 0
    if any(timed and n in bound for n, _, timed in missed):
        print("a target was missed by a harness-bound run: etcd's own pace is unknown",
              file=sys.stderr)
        return 2
    return 1


def _print_details(label: str, report: SwarmReport) -> None:
    for phase in report.phases:
        ops = {k: v for k, v in sorted(phase.ops.items())}
        print(f"{label:<16} {phase.name:<7} {phase.seconds:6.2f} s  ops {ops}  retries "
              f"{phase.retries}  etcd {phase.etcd_rate:.0f} req/s {_int(phase.etcd)} "
              f"cpu {phase.etcd_cpu or 0:.2f} (waited {phase.etcd_cpu_wait * 1000:.0f} ms) "
              f"harness cpu {phase.harness_cpu:.2f} fsyncs {phase.fsyncs[0]} "
              f"({1000 * phase.fsyncs[1] / max(1, phase.fsyncs[0]):.1f} ms each)  "
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
        if ref is None:
            line += f"{'-':>7} {'-':>5} {'-':>6}"
        elif not ref.answered:
            line += f"{ref.seconds:>7.2f} killed: no answer"
        else:
            line += f"{ref.seconds:>7.2f} {ref.ops / n:>5.1f} {ref.joined:>4}/{n}"
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
