"""One chaos trial end to end, the reference run it is compared with, and the sweep after.

:func:`run_trial` gives a fault a fresh etcd, folder and process ledger, injects it,
waits for every job, then audits: parameters against the :class:`Reference` run,
steps (:func:`.audit.audit_steps`), committed checkpoints, and processes left behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import psutil

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness.chaos.audit import TrialResult, audit_steps
from elastic_rt.harness.chaos.config import TOLERANCE, ChaosConfig
from elastic_rt.harness.chaos.faults import FAULTS
from elastic_rt.harness.chaos.trial import Job, Trial
from elastic_rt.harness.ledger import ProcessLedger
from elastic_rt.harness.waits import WaitTimeout, wait_until

logger = logging.getLogger("chaos")

_SAMPLE_EVERY_S = 0.2
_ORPHAN_GRACE_S = 10.0


def run_trial(fault: str, index: int, cfg: ChaosConfig, rng: random.Random, root: Path,
              reference: Reference) -> TrialResult:
    """Inject ``fault`` once into fresh jobs on a fresh etcd and audit the outcome."""
    skip = FAULTS[fault].skip_reason()
    if skip:
        return TrialResult(fault, index, 0.0, False, False, 0, 0, 0, 0, (), (), skipped=skip)
    began = time.monotonic()
    trial_dir = root / f"{fault}-{index}"
    trial_dir.mkdir(parents=True)
    ledger = ProcessLedger(sample_every=_SAMPLE_EVERY_S)
    etcd = EtcdServer(host=FAULTS[fault].etcd_host()).start()
    if etcd.pid is not None:
        ledger.adopt(etcd.pid)
    trial = Trial(cfg, trial_dir, etcd, ledger, index)
    try:
        FAULTS[fault].inject(trial, rng)
        finished = all(job.wait_done(max(1.0, cfg.trial_timeout - (time.monotonic() - began)))
                       for job in trial.jobs)
    except Exception as exc:  # noqa: BLE001 - a harness error is a failed trial, with its reason
        logger.exception("trial %s-%d crashed", fault, index)
        trial.problem(f"harness: {exc!r}")
        finished = False
    finally:
        FAULTS[fault].cleanup()
    want = reference.params()
    equal = finished and all(_params_equal(job.out, want) for job in trial.jobs)
    lost = repeated = redone = damaged = 0
    for job in trial.jobs:
        job_lost, job_repeated, job_redone = audit_steps(job.events(), cfg.steps)
        lost, repeated, redone = lost + job_lost, repeated + job_repeated, redone + job_redone
        damaged += _damaged_checkpoints(job)
    orphans = sweep(trial, etcd)
    result = TrialResult(fault, index, time.monotonic() - began, finished, equal, lost, repeated,
                         damaged, orphans, tuple(trial.problems), tuple(trial.checks),
                         redone=redone)
    if result.passed:
        shutil.rmtree(trial_dir, ignore_errors=True)
    else:
        logger.warning("trial %s-%d failed; logs kept in %s", fault, index, trial_dir)
    return result


def sweep(trial: Trial, etcd: EtcdServer) -> int:
    """Count (and kill) what outlives the trial.

    etcd is stopped and every agent still running (a trial that did not finish,
    already reported) is SIGKILLed, but not its workers: those must die with it.
    """
    etcd.stop()
    for job in trial.jobs:
        for node in job.nodes.values():
            if node.proc.poll() is None:
                node.proc.kill()
    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not trial.ledger.alive(), _ORPHAN_GRACE_S, "no process left")
    left = trial.ledger.alive()
    for proc in left:
        trial.problem(f"orphan {proc.pid}: {' '.join(_cmdline(proc))[:120]}")
        with contextlib.suppress(psutil.Error):
            proc.kill()
    trial.ledger.close()
    return len(left)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]


def _params_equal(path: Path, want: dict[str, Any]) -> bool:
    return param_diff(path, want) <= TOLERANCE


def param_diff(path: Path, want: dict[str, Any]) -> float:
    """The largest absolute difference between the parameters saved at ``path`` and
    ``want``; infinite when the file is missing or unreadable or names other tensors."""
    import torch

    try:
        got = torch.load(path)
    except (OSError, RuntimeError, EOFError):
        return math.inf
    if set(got) != set(want) or any(got[k].shape != want[k].shape for k in want):
        return math.inf
    return max((float((got[k] - want[k]).abs().max()) for k in want if want[k].numel()),
               default=0.0)


def _damaged_checkpoints(job: Job) -> int:
    if job.ckpt_dir is None or not job.ckpt_dir.exists():
        return 0
    from elastic_rt.checkpoint.inspect import verify

    ok, lines = verify(f"file://{job.ckpt_dir}")
    committed = [line for line in lines if line.startswith("step-")]
    job.trial.check(bool(committed),
                    f"{job.run_id}: committed checkpoints exist ({len(committed)})")
    return 0 if ok else sum("CORRUPT" in line for line in lines)


class Reference:
    """A 1-node run of the same script and steps, on its own etcd, started at once."""

    def __init__(self, cfg: ChaosConfig, root: Path) -> None:
        self.dir = root / "reference"
        self.dir.mkdir(parents=True)
        self.ledger = ProcessLedger(sample_every=_SAMPLE_EVERY_S)
        self.etcd = EtcdServer().start()
        self.trial = Trial(cfg, self.dir, self.etcd, self.ledger)
        self.job = self.trial.job("reference", nnodes="1")
        self.job.start_node("solo")
        self._params: dict[str, Any] | None = None

    def params(self) -> dict[str, Any]:
        if self._params is None:
            import torch

            if not self.job.wait_done(self.trial.cfg.trial_timeout):
                raise RuntimeError(f"the reference run failed: {self.trial.problems}; "
                                   f"see {self.dir}")
            self._params = torch.load(self.job.out)
            self.close()
        return self._params

    def close(self) -> None:
        sweep(self.trial, self.etcd)
