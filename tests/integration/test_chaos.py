"""A quick subset of the chaos matrix (``scripts/chaos.py``): one trial of four faults.

Each trial is a fresh 3-node in-process job on its own etcd, the fault injected at a
moment drawn from a fixed seed; a 1-node reference run starts beside the first trial.
A trial passes when the job finished, its final parameters equal the reference's,
no step was lost or repeated, no checkpoint is damaged, no process is left behind,
and the fault's own checks held (fenced and rejoined, training went on...).
The full matrix is ``python scripts/chaos.py --trials N``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import pytest

from elastic_rt.events import Event
from scripts import chaos

CONFIG = chaos.ChaosConfig(steps=24, trial_timeout=120.0)
SEED = 20240611


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[chaos.Reference]:
    ref = chaos.Reference(CONFIG, tmp_path_factory.mktemp("chaos-reference"))
    yield ref
    ref.close()


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", ["sigkill-mid-step", "sigkill-worker", "sigstop-node",
                                   "etcd-restart"])
def test_fault_leaves_training_unchanged(fault: str, reference: chaos.Reference,
                                         tmp_path: Path) -> None:
    rng = random.Random(f"{SEED}-{fault}")
    result = chaos.run_trial(fault, 0, CONFIG, rng, tmp_path, reference)
    print(chaos.table([result]))
    assert result.passed, (result, f"logs under {tmp_path}")


# the step audit, on made-up event logs -----------------------------------------------
def _done(node: str, round_: int, step: int, rank: int = 0) -> Event:
    return Event("step.completed", "worker", 0, node=node, rank=rank, round=round_, step=step)


def _round(number: int, *members: str) -> Event:
    return Event("round.formed", "agent", 0, round=number, metadata={"members": list(members)})


def test_audit_counts_a_clean_run_as_neither_lost_nor_repeated() -> None:
    log = [_round(0, "a", "b"), *(_done("a", 0, s) for s in (1, 2, 3))]
    assert chaos.audit_steps(log, 3) == (0, 0, 0)


def test_audit_accepts_a_step_redone_after_its_node_died() -> None:
    log = [_round(0, "a", "b"), _done("a", 0, 1), _done("a", 0, 2), _round(1, "b"),
           _done("b", 1, 2), _done("b", 1, 3)]
    assert chaos.audit_steps(log, 3) == (0, 0, 1)


def test_audit_flags_a_step_redone_while_its_state_survived() -> None:
    log = [_round(0, "a", "b"), _done("a", 0, 1), _done("a", 0, 2), _round(1, "a", "b"),
           _done("a", 1, 2), _done("a", 1, 3)]
    assert chaos.audit_steps(log, 3) == (0, 1, 0)


def test_audit_flags_skipped_and_missing_steps_as_lost() -> None:
    log = [_round(0, "a"), _done("a", 0, 1), _done("a", 0, 3)]
    assert chaos.audit_steps(log, 4) == (2, 0, 0)


def test_audit_accepts_a_step_only_another_rank_completed_before_handing_its_state_on() -> None:
    log = [_round(0, "a", "b"), _done("a", 0, 1), _done("b", 0, 1, rank=1),
           _done("b", 0, 2, rank=1), _round(1, "a", "b"), _done("a", 1, 3)]
    assert chaos.audit_steps(log, 3) == (0, 0, 0)
