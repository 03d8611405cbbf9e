"""Restart mode end to end: an unmodified torchrun DDP script under real agents.

Three agents with one gloo worker each share one real etcd. Faults are real
signals to real process trees.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from elastic_rt.harness import child_env, wait_until
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import TORCHRUN_SCRIPT, events, launch_args, progress

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(240)]


def _start_node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str, nnodes: str,
                steps: int, extra: tuple[str, ...] = ()):
    args = launch_args(etcd_server.endpoint, run_id, nnodes, tmp / "events.jsonl", node_id=name,
                       extra=extra)
    script = [TORCHRUN_SCRIPT, "--steps", str(steps), "--ckpt", str(tmp / "ckpt.pt"),
              "--ckpt-every", "2", "--progress", str(tmp / "progress.jsonl"), "--step-time", "0.1"]
    return tree.elastic_rt(*args, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _max_step(tmp: Path, world_size: int | None = None) -> int:
    rows = progress(tmp / "progress.jsonl")
    return max((r["step"] for r in rows if world_size in (None, r["world_size"])), default=0)


def test_sigkill_of_a_node_leaves_survivors_finishing_with_world_size_two(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    steps = 40
    nodes = {n: _start_node(process_tree, etcd_server, run_id, tmp_path, n, "2:3", steps)
             for n in ("a", "b", "c")}
    wait_until(lambda: _max_step(tmp_path, 3) >= 8, 120, "step 8 with world size 3")
    process_tree.sample()
    victim_workers = [c.pid for c in psutil.Process(nodes["c"].pid).children(recursive=True)]
    os.killpg(nodes["c"].pid, signal.SIGKILL)
    assert nodes["a"].wait(timeout=150) == 0
    assert nodes["b"].wait(timeout=30) == 0
    assert nodes["c"].wait(timeout=5) == -signal.SIGKILL
    rows = progress(tmp_path / "progress.jsonl")
    assert max(r["step"] for r in rows if r["world_size"] == 2) == steps
    assert {r["rank"] for r in rows if r["world_size"] == 2 and r["step"] == steps} == {0, 1}
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in victim_workers)
    names = [e.name for e in events(tmp_path / "events.jsonl")]
    assert "node.lost" in names
    formed = [e for e in events(tmp_path / "events.jsonl") if e.name == "round.formed"]
    assert formed[-1].metadata["world_size"] == 2
