"""``elastic-rt launch`` with torchrun's flags, as a torchrun user types them.

Each test runs the real CLI as a subprocess with a private etcd (``--standalone``)
and a worker script that does not import torch, so a launch takes a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_rt.harness import child_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.etcd]

SHOW_ENV = """
import os, sys
keys = ("RANK", "ROLE_NAME", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), "argv=" + ",".join(sys.argv))
print("to stderr", file=sys.stderr)
"""


def _launch(
    tmp: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp / "show_env.py"
    script.write_text(SHOW_ENV)
    cli = [sys.executable, "-m", "elastic_rt.cli", "launch", "--standalone"]
    return subprocess.run(
        [*cli, *flags, str(script), "x"],
        capture_output=True, text=True, timeout=90, env=env or child_env(), cwd=tmp,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_tee_with_a_rank_filter_logs_every_rank_and_shows_only_the_chosen(tmp_path: Path) -> None:
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    logs = tmp_path / "logs" / "new"
    result = _launch(tmp_path, "--nproc-per-node", "2", "--role", "trainer", "--log-dir", str(logs),
                     "-t", "3", "--local-ranks-filter", "1", "--run-path", env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[trainer1]:RANK=1 ROLE_NAME=trainer OMP_NUM_THREADS=1" in result.stdout
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in result.stdout
    assert f"argv={tmp_path / 'show_env.py'},x" in result.stdout  # runpy keeps torchrun's argv
    assert "[trainer0]:" not in result.stdout + result.stderr
    assert "[trainer1]:to stderr" in result.stderr
    assert "Setting OMP_NUM_THREADS environment variable" in result.stderr
    outs = sorted(logs.glob("workers_*/attempt_0/*/stdout.log"))
    assert [p.parent.name for p in outs] == ["0", "1"]
    assert outs[0].read_text().startswith("RANK=0 ROLE_NAME=trainer")


def test_a_users_omp_threads_is_kept_and_not_warned_about(tmp_path: Path) -> None:
    env = {**child_env(), "OMP_NUM_THREADS": "3"}
    result = _launch(tmp_path, "--nproc-per-node", "2", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("OMP_NUM_THREADS=3") == 2
    assert "Setting OMP_NUM_THREADS" not in result.stderr


def test_redirect_sends_output_only_to_the_files(tmp_path: Path) -> None:
    result = _launch(tmp_path, "--log-dir", str(tmp_path / "logs"), "-r", "1")
    assert result.returncode == 0, result.stderr
    assert "RANK=0" not in result.stdout
    (out,) = (tmp_path / "logs").glob("workers_*/attempt_0/0/stdout.log")
    assert "RANK=0" in out.read_text()
    assert "to stderr" in result.stderr  # stream 2 was not redirected


def test_master_port_on_one_node_is_accepted_with_a_warning(tmp_path: Path) -> None:
    result = _launch(tmp_path, "--node-rank", "0", "--master-port", "29511")
    assert result.returncode == 0, result.stderr
    assert "--node-rank, --master-port: not needed on one node" in result.stderr


def test_nproc_per_node_cpu_starts_one_worker_per_usable_cpu(tmp_path: Path) -> None:
    result = _launch(tmp_path, "--nproc-per-node", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("RANK=") == len(os.sched_getaffinity(0))
