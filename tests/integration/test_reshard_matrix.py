"""Save under one layout, restore under another: same outputs, and training goes on the same.

All cases run in one launch of four gloo workers (starting processes is the slow part on two
cores). Per case, the workers of layout A train ``STEPS_BEFORE`` steps, save and commit a
checkpoint, and destroy their groups; the workers of layout B form new groups in the same
processes, load it (resharding), predict, and train ``STEPS_AFTER`` more steps. The test
process compares both against :class:`ReferenceTrainer`, the unchanged single-process run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.harness import REPO
from elastic_rt.layout import Layout
from elastic_rt.process_groups import destroy_groups, init_groups
from elastic_rt.harness import parallel_models as pm
from tests.fixtures.torchdist import WorkerEnv, run_workers

NPROCS = 4
STEPS_BEFORE, STEPS_AFTER = 2, 2
FILE_CASES = [
    ("dp2", "dp1"),
    ("dp1", "dp3"),
    ("pp2", "dp1"),
    ("dp2xpp2", "dp3"),
    ("dp2xpp2", "pp2"),
    ("tp2", "dp2"),
    ("dp1", "pp2xtp2"),
    ("pp2xtp2", "dp2xpp2"),
    ("fsdp4", "fsdp3"),
    ("hsdp2x2", "fsdp3"),
    ("fsdp2", "dp1"),
    ("dp2xpp2", "fsdp4"),
]
S3_CASES = [("dp2xpp2", "dp3"), ("tp2", "dp2")]
TIMEOUT = timedelta(seconds=30)
EXAMPLE = REPO / "scripts" / "examples" / "parallel_models.py"


def _probe() -> torch.Tensor:
    return pm.make_batch(10_000)[0]


def _round(env: WorkerEnv, layout: Layout, prefix: str) -> Any:
    return init_groups(env.store, rank=env.rank, world_size=layout.world_size, layout=layout,
                       prefix=prefix, timeout=TIMEOUT)


def _save_under(env: WorkerEnv, layout: Layout, url: str, prefix: str,
                options: dict | None) -> torch.Tensor:
    groups = _round(env, layout, prefix)
    trainer = pm.build(layout, groups)
    for step in range(STEPS_BEFORE):
        trainer.step(pm.make_batch(step))
    ckpt = Checkpointer(url, storage_options=options)
    ckpt.save(STEPS_BEFORE, {"trainer": trainer}, layout=layout.to_dict(),
              process_group=groups.world)
    ckpt.wait()
    # Nobody may start reading before every rank's part is committed.
    dist.barrier(group=groups.world)
    ckpt.close()
    prediction = trainer.predict(_probe())
    destroy_groups(groups)
    return prediction


def _restore_under(env: WorkerEnv, layout: Layout, url: str, prefix: str,
                   options: dict | None) -> dict[str, Any]:
    groups = _round(env, layout, prefix)
    trainer = pm.build(layout, groups)
    ckpt = Checkpointer(url, storage_options=options)
    info = ckpt.load({"trainer": trainer}, process_group=groups.world)
    ckpt.close()
    prediction = trainer.predict(_probe())
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        trainer.step(pm.make_batch(step))
    params = trainer.full_params()
    destroy_groups(groups)
    return {"step": info.step, "prediction": prediction, "params": params}


def _run_cases(env: WorkerEnv, base_url: str, cases: list[tuple[str, str]],
               options: dict | None) -> dict:
    results: dict[str, dict[str, Any]] = {}
    for i, (before, after) in enumerate(cases):
        url = f"{base_url}/case{i}-{before}-to-{after}"
        out: dict[str, Any] = {}
        layout_a, layout_b = pm.parse_layout(before), pm.parse_layout(after)
        if env.rank < layout_a.world_size:
            out["saved_prediction"] = _save_under(env, layout_a, url, f"/reshard/{i}/a/", options)
        if env.rank < layout_b.world_size:
            out.update(_restore_under(env, layout_b, url, f"/reshard/{i}/b/", options))
        results[f"{before}->{after}"] = out
    return results


def _reference() -> dict[str, Any]:
    ref = pm.ReferenceTrainer()
    for step in range(STEPS_BEFORE):
        ref.step(pm.make_batch(step))
    prediction = ref.predict(_probe())
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        ref.step(pm.make_batch(step))
    return {"prediction": prediction, "params": ref.full_params()}


def _check(case: str, results: list[dict], reference: dict[str, Any]) -> None:
    per_rank = [r[case] for r in results]
    saved = [r["saved_prediction"] for r in per_rank if "saved_prediction" in r]
    restored = [r for r in per_rank if "prediction" in r]
    assert saved and restored
    for prediction in saved:
        torch.testing.assert_close(prediction, reference["prediction"], atol=1e-5, rtol=0)
    params: dict[str, torch.Tensor] = {}
    for out in restored:
        assert out["step"] == STEPS_BEFORE
        # The restored model answers exactly like the one that was saved.
        torch.testing.assert_close(out["prediction"], saved[0], atol=1e-6, rtol=0)
        params.update(out["params"])
    # Between the restored ranks every parameter is there, and training went on as if unchanged.
    assert params.keys() == reference["params"].keys()
    for name, value in params.items():
        torch.testing.assert_close(value, reference["params"][name], atol=1e-5, rtol=0, msg=name)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _reference()


@pytest.fixture(scope="module")
def file_matrix(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    base = tmp_path_factory.mktemp("reshard").as_uri()
    return run_workers(_run_cases, NPROCS, args=(base, FILE_CASES, None), timeout_s=180)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", FILE_CASES)
def test_restore_into_another_layout_on_file(file_matrix: list[dict], reference: dict,
                                             before: str, after: str) -> None:
    _check(f"{before}->{after}", file_matrix, reference)


@pytest.mark.slow
@pytest.mark.s3
def test_restore_into_another_layout_on_s3(s3_server: dict[str, Any], s3_url: str,
                                           reference: dict) -> None:
    results = run_workers(_run_cases, NPROCS, args=(s3_url, S3_CASES, s3_server), timeout_s=180)
    for before, after in S3_CASES:
        _check(f"{before}->{after}", results, reference)


def _torchrun(nprocs: int, *args: str) -> dict[int, float]:
    """Run the example under torchrun; its loss by step, from rank 0's output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nprocs}", str(EXAMPLE), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, out
    lines = re.finditer(r"^step (\d+) layout \S+ loss (\S+)$", out, re.MULTILINE)
    return {int(m[1]): float(m[2]) for m in lines}


@pytest.mark.slow
def test_example_resumes_under_torchrun_with_fewer_workers(tmp_path: Path) -> None:
    url = (tmp_path / "ckpt").as_uri()
    # Kept to three workers in all: each one imports torch, the slow part on two cores.
    before = _torchrun(2, "--layout", "pp2", "--steps", "2", "--ckpt", url)
    after = _torchrun(1, "--steps", "4", "--ckpt", url)  # planned for one worker: dp1
    reference = pm.ReferenceTrainer()
    expected = [reference.step(pm.make_batch(step)) for step in range(4)]
    assert sorted(before) == [0, 1] and sorted(after) == [2, 3]
    for step, loss in {**before, **after}.items():
        assert loss == pytest.approx(expected[step], abs=1e-5), step
