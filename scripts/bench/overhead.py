"""Steady-state step time and peak memory: elastic-rt's in-process loop vs torchrun + DDP.

With ``--fsdp`` the same for the shard axis: elastic-rt with ``max_shard`` (FSDP2 over both
workers, peer copies every ``--peer-copy-every`` steps) vs torchrun + ``fully_shard``.

One node, 2 gloo workers on CPU, ``scripts/bench/steady_train.py`` on both sides (the
same model, data, global batch, AdamW and DataLoader worker processes):

- elastic-rt: ``elastic-rt launch --nnodes 1 --nproc-per-node 2 steady_train.py --loop
  elastic`` (``elastic_rt.run``; gradients summed in buckets during backward).
- torchrun: ``torchrun --standalone --nproc-per-node 2 steady_train.py --loop ddp``
  (DistributedSampler, DataLoader, DistributedDataParallel).

Cases: ``mlp10m`` (4 x Linear(2048, 2048), 16.8M parameters, global batch 32,
``DataLoader(num_workers=2)``), ``mlp10m-io`` (the same with a dataset that waits 2 ms
per sample, as one reading from storage does), ``small`` (2 x Linear(256, 256): the
loop's fixed cost per step shows).

A run's step time is the median over windows of ``--window`` steps of the window's
mean, after ``--warmup`` steps (the median of windows shrugs off the spikes other
processes on a shared machine cause). Runs of the two loops alternate, ``--repeats``
times each; the figure is the median over runs. Peak RSS is the larger of the two
training processes' ``ru_maxrss`` (DataLoader worker processes are alike on both sides
and not counted). Page faults per step are the larger of the two processes' minor faults
over the steady steps: memory the heap gave back and the next step faulted in again (an
allocator that trims too eagerly shows here first).

Run:  python scripts/bench/overhead.py                  # ~10 min
      python scripts/bench/overhead.py --cases mlp10m --repeats 1 --steps 80
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

from _common import fmt, interruptible, median, table

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import PYTHON, REPO, ProcessLedger, child_env

SCRIPT = str(REPO / "scripts" / "bench" / "steady_train.py")
CASES = {
    "mlp10m": ["--width", "2048", "--layers", "4", "--global-batch", "32"],
    "mlp10m-io": ["--width", "2048", "--layers", "4", "--global-batch", "32", "--fetch-ms", "2"],
    "small": ["--width", "256", "--layers", "2", "--global-batch", "64"],
}
LOOPS = ("elastic-rt", "torchrun+DDP")


def steady_step_time(times: list[float], warmup: int, window: int) -> float:
    """Median over windows of the mean step time, after ``warmup`` steps (seconds)."""
    steady = times[warmup:]
    means = [(steady[i + window] - steady[i]) / window
             for i in range(0, len(steady) - window, window)]
    if not means:
        raise ValueError(f"only {len(times)} steps; need more than warmup + window")
    return statistics.median(means)


def run_once(loop: str, case: str, args: argparse.Namespace, etcd: EtcdServer,
             work: Path) -> tuple[list[float], float, float]:
    """(step start times of rank 0, peak RSS in MiB and minor page faults per steady step,
    the larger over the ranks) of one run."""
    times, rss = work / "times.json", work / "rss"
    for old in [times, *work.glob("rss.*")]:
        old.unlink(missing_ok=True)
    script = [SCRIPT, *CASES[case], "--steps", str(args.steps), "--num-workers",
              str(args.num_workers), "--times", str(times), "--rss", str(rss)]
    if args.fsdp:
        script += ["--max-shard", "64", "--peer-copy-every", str(args.peer_copy_every)]
    if loop == "elastic-rt":
        command = [PYTHON, "-m", "elastic_rt.cli", "launch", "--nnodes", "1",
                   "--nproc-per-node", "2", "--rdzv-endpoint", f"etcd://{etcd.endpoint}",
                   "--run-id", f"overhead-{uuid.uuid4().hex[:6]}", *script, "--loop", "elastic"]
    else:
        command = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                   "--nproc-per-node", "2", *script, "--loop", "fsdp" if args.fsdp else "ddp"]
    _run(command, work / f"{loop}.log", args.timeout)
    ranks = [json.loads(p.read_text()) for p in work.glob("rss.*")]
    faults = [(r["minflt"][-1] - r["minflt"][args.warmup]) / (len(r["minflt"]) - 1 - args.warmup)
              for r in ranks]
    return json.loads(times.read_text()), max(r["peak_mib"] for r in ranks), max(faults)


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
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["mlp10m", "mlp10m-io"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--keep", action="store_true", help="keep logs")
    p.add_argument("--fsdp", action="store_true", help="the shard axis vs torchrun + FSDP2")
    p.add_argument("--peer-copy-every", type=int, default=1,
                   help="--fsdp: elastic-rt's peer copies every N steps (0: off)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    print(f"overhead benchmark: 1 node x 2 gloo workers (OMP_NUM_THREADS=1), cases "
          f"{', '.join(args.cases)}, {args.steps} steps (first {args.warmup} skipped), "
          f"DataLoader num_workers={args.num_workers}, {args.repeats} alternating runs each; "
          f"load average {os.getloadavg()[0]:.1f}; logs in {work}", flush=True)
    steps: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], list[float]] = {}
    faults: dict[tuple[str, str], list[float]] = {}
    loops = (LOOPS[0], "torchrun+FSDP2") if args.fsdp else LOOPS
    try:
        with interruptible(), EtcdServer() as etcd:
            for case in args.cases:
                for i in range(args.repeats):
                    for loop in (loops if i % 2 == 0 else loops[::-1]):
                        began = time.monotonic()
                        times, peak, fault = run_once(loop, case, args, etcd, work)
                        step = steady_step_time(times, args.warmup, args.window)
                        steps.setdefault((case, loop), []).append(step)
                        peaks.setdefault((case, loop), []).append(peak)
                        faults.setdefault((case, loop), []).append(fault)
                        print(f"  {case} run {i + 1} {loop}: {step * 1000:.1f} ms/step, peak RSS "
                              f"{peak:.0f} MiB, {fault:.0f} page faults/step (run took "
                              f"{time.monotonic() - began:.0f} s; load average "
                              f"{os.getloadavg()[0]:.1f})", flush=True)
    except KeyboardInterrupt:
        print("interrupted; everything started was killed", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return _report(args.cases, steps, peaks, faults, loops)


def _report(cases: list[str], steps: dict[tuple[str, str], list[float]],
            peaks: dict[tuple[str, str], list[float]], faults: dict[tuple[str, str], list[float]],
            loops: tuple[str, str]) -> int:
    rows, verdicts = [], []
    twin_name = loops[1]
    for case in cases:
        ours, twin = (case, loops[0]), (case, loops[1])
        if ours not in steps or twin not in steps:
            continue
        step_ratio = median(steps[ours]) / median(steps[twin])  # type: ignore[operator]
        rss_ratio = max(peaks[ours]) / max(peaks[twin])
        for key in (ours, twin):
            ms = median(steps[key]) * 1000  # type: ignore[operator]
            rows.append([case, key[1], fmt(ms, ".1f"),
                         " ".join(f"{x * 1000:.1f}" for x in steps[key]), f"{max(peaks[key]):.0f}",
                         fmt(median(faults[key]), ".0f")])
        verdicts.append(f"{case}: step time {step_ratio:.3f}x {twin_name} (target <= 1.02: "
                        f"{'met' if step_ratio <= 1.02 else 'MISSED'}), peak RSS {rss_ratio:.3f}x "
                        f"(target <= 1.05: {'met' if rss_ratio <= 1.05 else 'MISSED'})")
    if not rows:
        return 1
    print()
    print(table(["case", "loop", "step ms (median)", "runs (ms)", "peak RSS MiB",
                 "page faults/step"], rows))
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
