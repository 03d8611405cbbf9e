"""``elastic-rt launch`` with torchrun's flags, as a torchrun user types them.

Each test runs the real CLI as a subprocess with a private etcd (``--standalone``)
and a worker script that does not import torch, so a launch takes a few seconds.
"""

from __future__ import annotations

import json
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


DUMP_ENV = """
import json, os, sys
with open(f"{sys.argv[1]}.{os.environ['RANK']}.json", "w") as f:
    json.dump(dict(os.environ), f)
"""
OURS_ONLY = ("ELASTIC_RT_", "GRPC_", "GLOO_SOCKET_IFNAME", "PYTHONUNBUFFERED")
# Values that name this run or this attempt, and flag defaults that differ on purpose
# (elastic-rt's --max-restarts defaults to 3, torchrun's to 0).
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID",
           "TORCHELASTIC_MAX_RESTARTS", "MASTER_ADDR",
           # torchrun's agent hosts the store ("True"); ours hosts none, so rank 0 does
           "TORCHELASTIC_USE_AGENT_STORE"}


def test_a_worker_gets_every_variable_stock_torchrun_sets_with_its_meaning(
        tmp_path: Path) -> None:
    """Both launchers side by side, two workers each, from the same clean environment."""
    (tmp_path / "dump_env.py").write_text(DUMP_ENV)
    clean = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    for launcher, name in ((["torch.distributed.run"], "torchrun"),
                           (["elastic_rt.cli", "launch"], "ours")):
        subprocess.run([sys.executable, "-m", *launcher, "--standalone", "--nproc-per-node", "2",
                        "dump_env.py", name], check=True, capture_output=True, timeout=90,
                       env=clean, cwd=tmp_path, stdin=subprocess.DEVNULL)
    for rank in (0, 1):
        theirs = json.loads((tmp_path / f"torchrun.{rank}.json").read_text())
        ours = json.loads((tmp_path / f"ours.{rank}.json").read_text())
        assert set(theirs) - set(ours) == set()
        assert {k for k in set(ours) - set(theirs) if not k.startswith(OURS_ONLY)} == set()
        differ = {k: (theirs[k], ours[k]) for k in set(theirs) - PER_RUN
                  if theirs[k] != ours[k]}
        assert differ == {}
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert ours["MASTER_ADDR"] in ("127.0.0.1", "localhost") and ours["MASTER_PORT"].isdigit()
        for key in ("RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE",
                    "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
            assert ours[key] == theirs[key], key
