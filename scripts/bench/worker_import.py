"""What a worker imports before it can train: torch alone against each kind of job.

Every worker start (the first round, a replacement in restart mode, a newcomer's standby
start) begins with these imports, and on a loaded node they are most of it. A data-parallel
worker should pay for torch and little else; torch's pipelining (which loads dynamo), DTensor
and torch.distributed.checkpoint are loaded by the jobs that use them. Each case runs in a
fresh interpreter, the cases alternating within each repeat so that load on the machine falls
on all alike; printed: the median wall time of each and its excess over torch alone.

    python scripts/bench/worker_import.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "torch + torch.distributed (the floor)": "import torch, torch.distributed",
    "data-parallel worker": "import elastic_rt as ert\nert.run, ert.TrainState, ert.LoaderOptions",
    "data-parallel worker with checkpoints": "import elastic_rt as ert\nert.run, ert.Checkpointer",
    "FSDP worker (the script imports DTensor)": (
        "import elastic_rt as ert\nert.run, ert.ModelLimits\n"
        "from elastic_rt.worker.trainers.sharded.trainer import ShardedTrainer"),
    "runtime-parallel worker (pipelining)": "import elastic_rt as ert\nert.run, ert.ModelParallel",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    return p.parse_args()


def wall_seconds(code: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - began


def main() -> None:
    args = parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for repeat in range(args.repeats):
        for name, code in CASES.items():
            times[name].append(wall_seconds(code))
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    floor = statistics.median(next(iter(times.values())))
    print(f"| imports | median wall (s), {args.repeats} fresh interpreters | beyond torch (s) |")
    print("| --- | --- | --- |")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"| {name} | {median:.2f} | {median - floor:+.2f} |")


if __name__ == "__main__":
    main()
