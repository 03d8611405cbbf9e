"""A node killed while the others are inside FSDP's forward, with a 10-minute collective timeout.

Four one-worker nodes train ``fsdp4`` (peer copies every step). At step 30 node c stops
inside its forward before the second layer's all-gather, so the others wait in that
all-gather, mid-forward; then c's whole process tree is SIGKILLed. Its two ring
neighbours' gloo connections close, but the survivor across the ring hears nothing: before
gloo waits went through the round's notice (``elastic_rt/noticed_gloo.py``) it sat there
for the whole collective timeout. Here the survivors must re-form at once, restore c's rows from the
peer copies (not from storage, not from scratch), redo at most one step, restart no
worker, and end with the parameters of an uninterrupted run: with no checkpoint
configured, and with one.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from elastic_rt.config import COLLECTIVE_TIMEOUT_ENV
from elastic_rt.harness import REPO, child_env, wait_until
from scripts.examples import fsdp_train as example
from tests.fixtures.fsdp_reference import reference_params
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "tests" / "fixtures" / "stalling_fsdp_train.py")
SURVIVORS = ("a", "b", "d")
STEPS, STALL_STEP, GLOBAL_BATCH, WIDTH, HIDDEN = 60, 30, 12, 32, 64
TEN_MINUTES = "600"


def _node(tree: ProcessTree, endpoint: str, run_id: str, tmp: Path, name: str,
          extra: list[str]):
    args = launch_args(endpoint, run_id, "3:4", tmp / "events.jsonl", node_id=name)
    script = [SCRIPT, "--steps", str(STEPS), "--step-time", "0.05", "--max-shard", "64",
              "--global-batch", str(GLOBAL_BATCH), "--out", str(tmp / "out"), *extra]
    env = child_env(**{COLLECTIVE_TIMEOUT_ENV: TEN_MINUTES, "STALL_NODE": "c",
                       "STALL_STEP": str(STALL_STEP), "STALL_MARKER": str(tmp / "stalled")})
    return tree.elastic_rt(*args, *script, env=env, log=str(tmp / f"{name}.log"))


@pytest.mark.parametrize("checkpoint", [False, True], ids=["no-checkpoint", "checkpoint"])
def test_a_node_killed_mid_forward_costs_one_step_at_most_and_no_restart(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path, checkpoint: bool
) -> None:
    extra = ["--checkpoint", str(tmp_path / "ckpt"), "--every", "5"] if checkpoint else []
    nodes = {n: _node(process_tree, etcd_server.endpoint, run_id, tmp_path, n, extra)
             for n in "abcd"}
    marker = tmp_path / "stalled"
    wait_until(marker.exists, 180, "c stopped inside its forward at step 30")
    process_tree.signal_tree(nodes["c"].pid, signal.SIGKILL)
    for name in SURVIVORS:
        assert nodes[name].wait(timeout=120) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    got = example.join_params(str(tmp_path / "out"))
    want = reference_params(steps=STEPS, global_batch=GLOBAL_BATCH, width=WIDTH, hidden=HIDDEN)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)

    log = events(tmp_path / "events.jsonl")
    assert not [e for e in log if e.name == "worker.restarted"], "recovery was not in-process"
    restored = {e.metadata["source"].split(" step-")[0] for e in log
                if e.name == "state.restored" and e.node in SURVIVORS}
    assert restored <= {"init", "peer copies"} and "peer copies" in restored, restored
    for survivor in SURVIVORS:  # every step done, at most one of them twice (the copy's step)
        steps = sorted(e.step or 0 for e in log
                       if e.name == "step.completed" and e.node == survivor)
        assert sorted(set(steps)) == list(range(1, STEPS + 1)), f"{survivor} skipped a step"
        assert len(steps) - STEPS <= 1, f"{survivor} redid {len(steps) - STEPS} steps"
    # the survivors were freed by the notice, not by the 10-minute collective timeout: one
    # by the notice itself (no connection of its own had closed)
    freed_by = {e.node: e.metadata["error"] for e in log if e.name == "step.retried"}
    assert "RoundAbandoned" in freed_by.values(), freed_by
    killed_at = marker.stat().st_mtime
    resumed = [e.timestamp_ms / 1000 for e in log if e.name == "step.completed"
               and e.node in SURVIVORS and e.step == STALL_STEP]
    assert resumed and max(resumed) - killed_at < 60, (resumed, killed_at)
