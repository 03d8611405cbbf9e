"""Steady-state step time: elastic-rt's in-process loop vs torchrun + plain DDP.

One node, 2 gloo workers on CPU, the same model, data and global batch:

- elastic-rt: ``elastic-rt launch --nnodes 1 --nproc-per-node 2
  scripts/examples/elastic_train.py`` (the library's ``run`` loop); step times
  from rank 0's ``step.completed`` events.
- torchrun: ``torchrun --standalone --nproc-per-node 2 scripts/bench/ddp_twin.py``
  (DistributedSampler, DataLoader, DDP); step times recorded in memory by rank 0.

The first ``--warmup`` steps are skipped. A run's step time is the median, over
windows of ``--window`` consecutive steps, of the window's mean step time (event
timestamps have 1 ms resolution; a window mean resolves 1/window ms, and the
median of windows shrugs off the spikes other processes on a shared machine
cause). Runs of the two alternate, ``--repeats`` times each, and the reported
figure is the median over runs.

Run:  python scripts/bench/overhead.py                  # ~3 min
      python scripts/bench/overhead.py --quick          # 1 run each, fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import JsonLines, fmt, interruptible, median, table

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import PYTHON, REPO, ProcessLedger, child_env

ELASTIC_SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
TWIN_SCRIPT = str(REPO / "scripts" / "bench" / "ddp_twin.py")


def steady_step_time(times: list[float], warmup: int, window: int) -> float:
    """Median over windows of the mean step time, after ``warmup`` steps (seconds)."""
    steady = times[warmup:]
    means = [(steady[i + window] - steady[i]) / window
             for i in range(0, len(steady) - window, window)]
    if not means:
        raise ValueError(f"only {len(times)} steps; need more than warmup + window")
    return statistics.median(means)


def run_elastic(args: argparse.Namespace, etcd: EtcdServer, work: Path) -> list[float]:
    events = work / "elastic-events.jsonl"
    events.unlink(missing_ok=True)
    command = [PYTHON, "-m", "elastic_rt.cli", "launch", "--nnodes", "1", "--nproc-per-node", "2",
               "--rdzv-endpoint", f"etcd://{etcd.endpoint}",
               "--run-id", f"overhead-{uuid.uuid4().hex[:6]}",
               "--events-file", str(events), ELASTIC_SCRIPT, *_model_args(args)]
    _run(command, work / "elastic.log", args.timeout)
    rows = JsonLines(events).poll()
    done = sorted((r["step"], r["timestamp_ms"] / 1000) for r in rows
                  if r.get("name") == "step.completed" and r.get("rank") == 0)
    return [t for _, t in done]


def run_torchrun(args: argparse.Namespace, work: Path) -> list[float]:
    out = work / "twin-times.json"
    out.unlink(missing_ok=True)
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", "2", TWIN_SCRIPT, *_model_args(args), "--times", str(out)]
    _run(command, work / "torchrun.log", args.timeout)
    return json.loads(out.read_text())


def _model_args(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--width", str(args.width),
            "--global-batch", str(args.global_batch)]


def _run(command: list[str], log: Path, timeout: float) -> None:
    procs = ProcessLedger()
    try:
        proc = procs.start(command, env=child_env(OMP_NUM_THREADS="1"), log=log)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{command[2]} exited with {code}:\n{tail}")
    finally:
        procs.close()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--width", type=int, default=1024, help="model input width (Linear(width, 64))")
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 run each, 200 steps")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--keep", action="store_true", help="keep logs")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.quick:
        args.repeats, args.steps = 1, min(args.steps, 200)
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    print(f"overhead benchmark: 1 node x 2 gloo workers (OMP_NUM_THREADS=1), "
          f"Linear({args.width}, 64)-Tanh-Linear(64, 1), global batch {args.global_batch}, "
          f"{args.steps} steps, first {args.warmup} skipped, {args.repeats} alternating runs "
          f"each; load average {os.getloadavg()[0]:.1f}; logs in {work}", flush=True)
    results: dict[str, list[float]] = {"elastic-rt": [], "torchrun+DDP": []}
    try:
        with interruptible(), EtcdServer() as etcd:
            for i in range(args.repeats):
                order = ["elastic-rt", "torchrun+DDP"]
                if i % 2:
                    order.reverse()
                for name in order:
                    began = time.monotonic()
                    times = (run_elastic(args, etcd, work) if name == "elastic-rt"
                             else run_torchrun(args, work))
                    step = steady_step_time(times, args.warmup, args.window)
                    results[name].append(step)
                    print(f"  run {i + 1} {name}: {step * 1000:.2f} ms/step ({len(times)} steps, "
                          f"run took {time.monotonic() - began:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted; everything started was killed", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not all(results.values()):
        return 1
    base = median(results["torchrun+DDP"])
    rows = [[name, fmt(median(v) * 1000), " ".join(f"{x * 1000:.2f}" for x in v),
             f"{median(v) / base:.3f}"] for name, v in results.items()]
    print()
    print(table(["loop", "step ms (median)", "runs (ms)", "ratio to torchrun+DDP"], rows))
    ratio = median(results["elastic-rt"]) / base
    verdict = "met" if ratio <= 1.02 else "MISSED"
    print(f"\nelastic-rt / torchrun+DDP = {ratio:.3f} (target <= 1.02): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
