"""Chaos matrix: inject every fault of DESIGN section 7 into real 3-node jobs.

Each fault is injected ``--trials`` times, at moments drawn from a seeded RNG (the
seed is printed), into a fresh 3-node job (one worker per node, in-process recovery,
``scripts/examples/elastic_train.py``). A 1-node reference run of the same script
and step count runs beside the first trial. Per fault the script prints one row:

- finished: every agent still alive exited 0 and the final parameters were written;
- params = ref: the final parameters equal the reference's within 1e-5;
- lost / repeated: audited from ``step.completed`` events of rank 0 (see
  :func:`elastic_rt.harness.chaos.audit.audit_steps`); a step skipped means samples
  lost, a step redone while its state survived means samples repeated;
- damaged ckpts: committed checkpoints that fail ``elastic_rt.checkpoint.inspect.verify``;
- orphans: processes started by the trial (and their children) still alive after it;
- checks: what the fault itself must show (fenced and rejoined, no stale writes...).

The bar is 100 % and zeros. Run it as::

    python scripts/chaos.py --trials 2 --seed 7            # the full matrix
    python scripts/chaos.py --faults sigkill-mid-step,etcd-restart --trials 5

It needs root for the network-namespace fault (``ip netns``); without it that row
says why it was skipped. This file is the command line only; the matrix itself is
the package :mod:`elastic_rt.harness.chaos` (``tests/integration/test_chaos.py``
runs one trial of four faults through its ``run.run_trial``).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
from pathlib import Path

from elastic_rt.harness.chaos.audit import TrialResult
from elastic_rt.harness.chaos.config import ChaosConfig
from elastic_rt.harness.chaos.faults import FAULTS
from elastic_rt.harness.chaos.report import table
from elastic_rt.harness.chaos.run import Reference, run_trial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2, help="injections per fault")
    parser.add_argument("--seed", type=int, default=None,
                        help="RNG seed (default: random, printed)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of: "
                        + ", ".join(FAULTS))
    parser.add_argument("--steps", type=int, default=ChaosConfig.steps)
    parser.add_argument("--workdir", default=None, help="where trial folders go (kept on failure)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s",
                        stream=sys.stderr)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; choose from {list(FAULTS)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"chaos: seed {seed}, {args.trials} trial(s) of {len(faults)} fault(s)", flush=True)
    rng = random.Random(seed)
    cfg = ChaosConfig(steps=args.steps)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="elastic-rt-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    reference = Reference(cfg, root)
    results: list[TrialResult] = []
    try:
        for fault in faults:
            for index in range(args.trials):
                result = run_trial(fault, index, cfg, rng, root, reference)
                results.append(result)
                print(f"  {fault} #{index}: {'PASS' if result.passed else result.skipped or 'FAIL'}"
                      f" in {result.seconds:.0f} s"
                      + "".join(f"\n    - {p}" for p in result.problems), flush=True)
                if result.skipped:
                    break
    finally:
        reference.close()
    print(f"\nchaos: seed {seed}\n{table(results)}")
    return 0 if all(r.passed or r.skipped for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
