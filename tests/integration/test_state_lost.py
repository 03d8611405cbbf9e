"""A job whose state is gone ends with one clear line; it never trains again from step 0.

One node, no checkpoint: once the job has trained, its only worker is SIGKILLed. The
agent starts the worker again (nobody is left to restore from in-process), and that
worker finds no survivor and nothing committed while the run has published progress.
Before, it started over from the initial state and the job "succeeded" having done its
first steps twice.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.worker.progress import published_step
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(180)]

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")


def test_all_state_lost_without_a_checkpoint_ends_the_job_instead_of_starting_over(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    log_path, out = tmp_path / "events.jsonl", tmp_path / "a.log"
    node = process_tree.elastic_rt(
        *launch_args(etcd_server.endpoint, run_id, "1", log_path, node_id="a"),
        SCRIPT, "--steps", "400", "--step-time", "0.05", env=child_env(), log=str(out))
    kv = EtcdKV(etcd_server.endpoint)
    try:
        registry = RunRegistry(kv, run_id)
        # The run has published progress (rank 0 hands over its step every few seconds).
        wait_until(lambda: published_step(registry) >= 5, timeout=90, what="published progress")
        started = next(e for e in events(log_path) if e.name == "worker.started")
        os.kill(started.metadata["pids"][0], signal.SIGKILL)
        assert node.wait(timeout=90) == 1, out.read_text()[-3000:]
        reason = registry.closed_reason()
    finally:
        kv.close()
    assert reason is not None and "was lost with no surviving copy and no committed " \
        "checkpoint" in reason, reason
    log = events(log_path)
    assert [e for e in log if e.name == "worker.restarted"], "the agent started the worker again"
    firsts = [e for e in log if e.name == "step.completed" and e.step == 1]
    assert len(firsts) == 1, "step 1 was trained again: the job started over"
    assert [e.metadata.get("source") for e in log if e.name == "state.restored"] == ["init"]
    assert "checkpoint=Checkpointer(url, every_steps=N)" in out.read_text()
