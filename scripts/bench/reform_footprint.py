"""What a surviving worker keeps per re-form: one node SIGKILLed and replaced, again and again.

Three nodes of one gloo worker (``--nnodes 2:3``, in-process recovery, the example's
2,000-parameter model) train while node ``c`` is SIGKILLed (its whole process group) and a
fresh node is started under a new id once the survivors have re-formed without it: two
re-forms a cycle, one that drops a member (its groups abandoned, then released) and one
that admits one. Node ``a`` lives through all of them; the ``footprint`` its worker writes
on every ``groups.reformed`` event (threads, open descriptors, RSS, groups of abandoned
rounds still held: ``elastic_rt/worker/footprint.py``) is the curve.

The soak (``scripts/bench/soak.py``) gives one worker 20-25 re-forms before a random fault
takes it; this gives one worker hundreds, so that a slow creep shows apart from the first
re-form's one-off cost (threads and buffers started once).

Beside it, torch alone: two processes make four gloo groups on a fresh store, all-reduce on
each, and drop them, ``--cycles`` times (what a re-form does to torch, with none of
elastic-rt's code): the per-cycle RSS growth that is torch's own.

Run:  python scripts/bench/reform_footprint.py                 # 50 cycles: 100 re-forms, ~7 min
      python scripts/bench/reform_footprint.py --cycles 10
"""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from _common import fmt, table

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.events import read_events
from elastic_rt.harness import PYTHON, REPO, ProcessLedger, child_env, wait_until
from elastic_rt.harness.soak.footprint import slope
from elastic_rt.worker.rss_peak import rss_bytes

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
SETTLE = 5
"""Re-forms left out of the slope: the first ones start what a worker keeps for its life
(the recovery's threads, the stream's listener), which is no growth per failure."""
GROUPS_PER_ROUND = 4
"""Process groups a round of this job makes (world, data, pipeline and tensor axes)."""


def footprints(events: Path, node: str) -> list[tuple[int, dict[str, int]]]:
    """(round, footprint) of every ``groups.reformed`` event of ``node``'s worker."""
    return [(event.round or 0, event.metadata["footprint"]) for event in read_events(str(events))
            if event.name == "groups.reformed" and event.node == node]


def latest_round(events: Path) -> int:
    return max((r for r, _ in footprints(events, "a")), default=-1)


def run_job(work: Path, cycles: int) -> list[tuple[int, dict[str, int]]]:
    events = work / "events.jsonl"
    ledger = ProcessLedger()
    with EtcdServer() as etcd:
        def node(name: str) -> int:
            command = [PYTHON, "-m", "elastic_rt.cli", "launch", "--nnodes", "2:3",
                       "--nproc-per-node", "1", "--rdzv-endpoint", f"etcd://{etcd.endpoint}",
                       "--run-id", "footprint", "--node-id", name, "--events-file", str(events),
                       "--lease-ttl", "3", "--last-call", "0.5",
                       SCRIPT, "--steps", "1000000", "--step-time", "0.05"]
            return ledger.start(command, env=child_env(), log=work / f"{name}.log").pid

        try:
            node("a")
            node("b")
            victim = node("c0")
            wait_until(lambda: latest_round(events) >= 0, 180, "the first round")
            for cycle in range(cycles):
                before = latest_round(events)
                os.killpg(victim, signal.SIGKILL)
                wait_until(lambda: latest_round(events) > before, 60, "the re-form without c")
                before = latest_round(events)
                victim = node(f"c{cycle + 1}")
                wait_until(lambda: latest_round(events) > before, 180, "the re-form with c")
                last = footprints(events, "a")[-1][1]
                print(f"  cycle {cycle + 1}/{cycles}: round {before + 1}, threads "
                      f"{last['threads']}, fds {last['open_fds']}, RSS "
                      f"{last['rss_bytes'] / 2**20:.1f} MiB", flush=True)
        finally:
            ledger.close()
    return footprints(events, "a")


def _gloo_cycles(rank: int, cycles: int, ports: "multiprocessing.Queue[int]",
                 out: "multiprocessing.Queue[list[int]]") -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    tensor = torch.ones(1000)
    rss = []
    for _ in range(cycles):
        if rank == 0:  # a fresh store a cycle, on a port the OS picks, as each round has
            store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout,
                                  wait_for_workers=False)
            ports.put(store.port)
        else:
            store = dist.TCPStore("127.0.0.1", ports.get(timeout=60), 2, False, timeout=timeout)
        groups = [dist.ProcessGroupGloo(dist.PrefixStore(f"g{k}", store), rank, 2, timeout)
                  for k in range(GROUPS_PER_ROUND)]
        for group in groups:
            cast(Any, group).allreduce([tensor]).wait()  # the backend's own, untyped in torch
        store.set(f"done{rank}", "1")
        store.wait([f"done{1 - rank}"])
        del groups, store
        gc.collect()
        rss.append(rss_bytes() or 0)
    if rank == 0:
        out.put(rss)


def torch_alone(cycles: int) -> list[int]:
    """RSS of one of two processes after each cycle of four gloo groups made and dropped."""
    context = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue[int] = context.Queue()
    out: multiprocessing.Queue[list[int]] = context.Queue()
    procs = [context.Process(target=_gloo_cycles, args=(rank, cycles, ports, out))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=50, help="kills and replacements of node c")
    p.add_argument("--workdir", type=Path, default=None, help="where logs go (kept)")
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-reform-footprint-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"re-form footprint: 3 nodes x 1 gloo worker, node c SIGKILLed and replaced "
          f"{args.cycles} times; logs in {work}", flush=True)
    began = time.monotonic()
    curve = run_job(work, args.cycles)
    print(f"job: {len(curve)} re-forms of node a's worker in {time.monotonic() - began:.0f} s",
          flush=True)
    settled = [f for _, f in curve[SETTLE:]]
    rows = []
    for key, scale, unit in (("threads", 1, ""), ("open_fds", 1, ""),
                             ("rss_bytes", 1024, " KiB"), ("abandoned_groups", 1, "")):
        values = [f[key] // scale for _, f in curve]
        after = [f[key] // scale for f in settled]
        rows.append([key + unit, fmt(values[0], ".0f"), fmt(after[0] if after else None, ".0f"),
                     fmt(values[-1], ".0f"), fmt(max(values), ".0f"),
                     fmt(slope(after), "+.2f"), fmt(slope(after[len(after) // 2:]), "+.2f")])
    print(table(["figure", "first round", f"re-form {SETTLE}", "last", "max",
                 f"slope per re-form after {SETTLE}", "over the last half"], rows))
    alone = torch_alone(max(2 * args.cycles, 50))
    torch_slope = slope([r // 1024 for r in alone[SETTLE:]])
    job_slope = slope([f["rss_bytes"] // 1024 for f in settled[len(settled) // 2:]])
    print(f"torch alone, {GROUPS_PER_ROUND} gloo groups made, used and dropped per cycle, "
          f"{len(alone)} cycles: RSS {alone[0] / 2**20:.1f} -> {alone[-1] / 2**20:.1f} MiB, "
          f"{fmt(torch_slope, '+.2f')} KiB a cycle; the job's worker "
          f"{fmt(job_slope, '+.2f')} KiB a re-form over the last half "
          f"({'-' if not torch_slope else f'{job_slope / torch_slope:.1f}x'}"
          " torch's own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
