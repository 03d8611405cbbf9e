"""A quick subset of the chaos matrix (``scripts/chaos.py``): one trial of the
fault the short soak does not draw.

Each trial is a fresh 3-node in-process job on its own etcd, the fault injected at a
moment drawn from a fixed seed; a 1-node reference run starts beside the first trial.
A trial passes when the job finished, its final parameters equal the reference's,
no step was lost or repeated, no checkpoint is damaged, no process is left behind,
and the fault's own checks held (fenced and rejoined, training went on...).
The full matrix is ``python scripts/chaos.py --trials N``; the audit's rules are
unit-tested in ``tests/unit/test_chaos_audit.py``. A node's SIGKILL mid-step, a worker's
SIGKILL and a node's SIGSTOP are among the kinds the short soak (``test_soak.py``) draws
its 40 faults from, one job through them all; the soak restarts one member of a
three-member etcd cluster, so the restart of the only etcd server is tried here.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import pytest

from elastic_rt.harness.chaos.config import ChaosConfig
from elastic_rt.harness.chaos.report import table
from elastic_rt.harness.chaos.run import Reference, run_trial

CONFIG = ChaosConfig(steps=24, trial_timeout=120.0)
SEED = 20240611


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    ref = Reference(CONFIG, tmp_path_factory.mktemp("chaos-reference"))
    yield ref
    ref.close()


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", ["etcd-restart"])
def test_fault_leaves_training_unchanged(fault: str, reference: Reference,
                                         tmp_path: Path) -> None:
    rng = random.Random(f"{SEED}-{fault}")
    result = run_trial(fault, 0, CONFIG, rng, tmp_path, reference)
    print(table([result]))
    assert result.passed, (result, f"logs under {tmp_path}")
