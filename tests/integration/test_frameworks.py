"""Framework scripts run unchanged under ``elastic-rt launch`` (restart mode) through a node kill.

A Lightning ``Trainer(strategy="ddp")`` and a plain Accelerate loop (the examples in
``scripts/examples/``, CPU/gloo) run on three nodes of one worker each against a real
etcd. One node's whole process tree is SIGKILLed mid-run; the survivors must restart at
world size 2 from the framework's own last checkpoint (not from scratch) and finish.
The frameworks are in the ``test`` extra: a missing one fails these tests, never skips
them (``-m "not frameworks"`` leaves them out on purpose).
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

from elastic_rt.harness import REPO, child_env, wait_until
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args, progress

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.frameworks,
              pytest.mark.timeout(240)]

STEPS = 30
KILL_AT = 6
"""World-size-3 step after which node c dies; both scripts checkpoint every 2 steps."""


@pytest.mark.parametrize("module, script", [("lightning", "lightning_ddp.py"),
                                            ("accelerate", "accelerate_loop.py")])
def test_survivors_resume_from_the_frameworks_checkpoint_at_world_size_two(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path, module: str,
    script: str
) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: pip install -e '.[test]'")
    rows_file = tmp_path / "progress.jsonl"
    command = [str(REPO / "scripts" / "examples" / script), str(tmp_path / "ckpt"),
               "--steps", str(STEPS), "--progress", str(rows_file)]
    nodes = {
        n: process_tree.elastic_rt(
            *launch_args(etcd_server.endpoint, run_id, "2:3", tmp_path / "events.jsonl",
                         node_id=n), *command, env=child_env(), log=str(tmp_path / f"{n}.log"))
        for n in ("a", "b", "c")
    }  # fmt: skip
    wait_until(lambda: any(r.get("step", 0) >= KILL_AT and r["world_size"] == 3
                           for r in progress(rows_file)), 120, f"step {KILL_AT} at world size 3")
    os.killpg(nodes["c"].pid, signal.SIGKILL)

    assert nodes["a"].wait(timeout=150) == 0
    assert nodes["b"].wait(timeout=30) == 0
    assert nodes["c"].wait(timeout=5) == -signal.SIGKILL
    rows = [r for r in progress(rows_file) if r["world_size"] == 2]
    starts = {r["rank"]: r["start"] for r in rows if "start" in r}
    assert sorted(starts) == [0, 1]
    assert all(0 < s <= STEPS for s in starts.values()), f"not resumed from a checkpoint: {starts}"
    assert {r["rank"] for r in rows if r.get("step") == STEPS} == {0, 1}
    log = events(tmp_path / "events.jsonl")
    assert [e for e in log if e.name == "round.formed"][-1].metadata["world_size"] == 2
    # a node lost is a membership change: the restarted workers' TORCHELASTIC_RESTART_COUNT
    # stays 0, as torchrun's counts only failure restarts
    restarted = [e for e in log if e.name == "worker.restarted"]
    assert {e.node for e in restarted} == {"a", "b"}
    assert {e.metadata["restart_count"] for e in restarted} == {0}
