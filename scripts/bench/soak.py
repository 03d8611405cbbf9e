"""Soak: one elastic job trains while hundreds of seeded random faults land on it.

One job of ``--nodes`` nodes (``elastic-rt launch --nnodes 2:N``, one gloo worker each,
in-process recovery with ``scripts/examples/elastic_train.py``, a 10-minute collective
timeout) runs against a three-member etcd cluster. Every ``--interval`` seconds or so
(drawn from 0.5x to 1.5x) a fault drawn from a seeded RNG lands:

- ``node-kill``: SIGKILL of a node's whole process tree;
- ``agent-leave``: SIGTERM to a node's agent alone (a graceful leave);
- ``node-stop``: SIGSTOP of a node past its peers' heartbeat window, then SIGCONT
  (it is evicted, fences itself and rejoins);
- ``worker-kill``: SIGKILL of a node's worker (its agent starts it again);
- ``netns-cut``: the node living in a network namespace is cut off for 1 s to TTL+1 s
  (needs root; skipped with the reason otherwise);
- ``etcd-restart``: SIGKILL of one etcd member, restarted on its data dir;

and every node a kill or a leave takes out is replaced at once by a fresh ``launch``
under a new ``--node-id`` (counted as ``node-join``). A fault that takes a node out
of the round lands only while the round keeps the job's minimum without it. A 1-node
uninterrupted run of the same script and steps runs beside it.

Printed: faults injected and survived by kind; whether the job finished; the final
parameters against the uninterrupted run (max abs diff, <= 1e-5); steps lost,
repeated and redone (the chaos audit over ``step.completed``); rounds formed; the
longest-lived worker's footprint (threads, descriptors, RSS, abandoned process
groups: first, last, max and least-squares slope per re-form); and what the run
left: keys and leases in etcd, temp-dir entries, processes.

Run:  python scripts/bench/soak.py                           # 500 faults (~40-60 min)
      python scripts/bench/soak.py --faults 100 --seed 7 --interval 3

This file is the command line only; the soak is :mod:`elastic_rt.harness.soak`.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import sys
import tempfile
from pathlib import Path

from _common import interruptible

from elastic_rt.harness.soak.config import KINDS, SoakConfig
from elastic_rt.harness.soak.report import report
from elastic_rt.harness.soak.run import run_soak


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=SoakConfig.faults, help="faults to draw")
    p.add_argument("--seed", type=int, default=None, help="RNG seed (default: random, printed)")
    p.add_argument("--interval", type=float, default=SoakConfig.interval,
                   help="mean seconds between one fault's end and the next")
    p.add_argument("--nodes", type=int, default=SoakConfig.nodes, help="nodes (the maximum)")
    p.add_argument("--min-nodes", type=int, default=SoakConfig.min_nodes,
                   help="the job's minimum; faults never take it below")
    p.add_argument("--steps", type=int, default=0,
                   help="training steps (default: sized so training outlasts the faults)")
    p.add_argument("--step-time", type=float, default=SoakConfig.step_time,
                   help="simulated compute per step (s); with the faults it sizes --steps")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: "
                   + ", ".join(KINDS))
    p.add_argument("--collective-timeout", type=float, default=SoakConfig.collective_timeout,
                   help="seconds a collective waits for a peer (ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC;"
                        " 600 as NCCL users set it)")
    p.add_argument("--stall-timeout", type=float, default=SoakConfig.stall_timeout,
                   help="seconds without a step after which the soak stops as hung")
    p.add_argument("--workdir", default=None, help="where logs go (kept on failure)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s",
                        stream=sys.stderr)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"soak: unknown fault kind(s) {unknown}; choose from {list(KINDS)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    cfg = SoakConfig(faults=args.faults, interval=args.interval, seed=seed, nodes=args.nodes,
                     min_nodes=args.min_nodes, steps=args.steps, step_time=args.step_time,
                     kinds=kinds, collective_timeout=args.collective_timeout,
                     stall_timeout=args.stall_timeout)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="elastic-rt-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"soak: seed {seed}, {cfg.faults} faults, {cfg.sized_steps} steps; logs in {root}",
          flush=True)
    with interruptible():
        result = run_soak(cfg, root)
    print(report(result), flush=True)
    if result.passed and args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
