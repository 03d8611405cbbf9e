"""Failure reports end to end, with real agents on a real etcd: the root cause, one retry
for a deterministic error, the hang report, and what ``elastic-rt status`` shows of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.policy import Failed
from agents.round_io import report_root_cause
from elastic_rt.config import EtcdAuth
from elastic_rt.errors import UnknownRunError
from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.root_cause import RootCause
from elastic_rt.ops.status import show_status
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180)]

ELASTIC_SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")

# A torchrun user's script with a bug in rank 1's setup; rank 0 waits for it meanwhile.
BAD_CONFIG = """
import os, time
if os.environ["RANK"] == "1":
    from torch.distributed.elastic.multiprocessing.errors import record

    def check_config():
        raise ValueError("bad config: lr must be positive")

    @record
    def main():
        check_config()

    main()
else:
    time.sleep(60)
"""


def _status(endpoint: str, run_id: str) -> dict:
    text = show_status(endpoint, run_id, auth=EtcdAuth(), events_file=None, as_json=True)
    return json.loads(text)


@pytest.mark.slow
def test_a_deterministic_error_is_retried_once_then_ends_the_job_with_its_root_cause(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    script = tmp_path / "bad_config.py"
    script.write_text(BAD_CONFIG)
    log = tmp_path / "agent.log"
    args = launch_args(etcd_server.endpoint, run_id, "1", tmp_path / "events.jsonl",
                       node_id="a", nproc=2, extra=("--max-restarts", "3"))
    agent = process_tree.elastic_rt(*args, str(script), env=child_env(), log=str(log))
    assert agent.wait(timeout=120) == 1
    output = log.read_text()
    assert output.count("Root Cause (first observed failure)") == 2  # once per attempt
    assert "rank      : 1 (round 1)" in output and "in check_config" in output
    restarted = [e for e in events(tmp_path / "events.jsonl") if e.name == "worker.restarted"]
    # a failure restart: torchrun's meaning of TORCHELASTIC_RESTART_COUNT
    assert [e.metadata["restart_count"] for e in restarted] == [1]
    status = _status(etcd_server.endpoint, run_id)
    assert "not retried again" in status["state"]
    assert "rank 1 on 127.0.0.1 (a): ValueError: bad config" in status["state"]
    assert (status["restarts_used"], status["max_restarts"], status["restarts_left"]) == (1, 3, 2)
    cause = status["root_cause"]
    assert (cause["rank"], cause["round"], cause["node"]) == (1, 1, "a")
    assert cause["error"] == "ValueError: bad config: lr must be positive"
    assert "in check_config" in cause["traceback"]


@pytest.mark.slow
def test_status_shows_step_rate_layout_and_budget_and_a_stalled_rank_is_reported(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    steps = 40
    # The stalled rank's peers wait in the all-reduce: longer than the stall, not the lease.
    env = {**child_env(), "ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC": "60"}
    script = [ELASTIC_SCRIPT, "--steps", str(steps), "--step-time", "0.05",
              "--stall-at-step", "25", "--stall-seconds", "4"]
    agents = {}
    for node, extra, node_env in (("a", ("--hang-factor", "5"), env),
                                  ("b", (), {**env, "ELASTIC_RT_HANG_FACTOR": "5"})):
        args = launch_args(etcd_server.endpoint, run_id, "2", tmp_path / "events.jsonl",
                           node_id=node, extra=extra)
        agents[node] = process_tree.elastic_rt(*args, *script, env=node_env,
                                               log=str(tmp_path / f"{node}.log"))

    def training() -> dict | None:
        try:
            status = _status(etcd_server.endpoint, run_id)
        except UnknownRunError:
            return None  # no agent has registered yet
        progress = status["progress"] or {}
        return status if progress.get("step", 0) >= 10 and progress["steps_per_s"] else None

    status = wait_until(training, 120, "status showing step 10 and a step rate")
    assert status["layout"] == {"round": status["round"]["number"],
                                "layout": {"dp": 2, "pp": 1, "tp": 1}}
    assert (status["max_restarts"], status["restarts_left"]) == (3, 3)
    assert status["root_cause"] is None
    assert agents["a"].wait(timeout=120) == 0 and agents["b"].wait(timeout=30) == 0

    final = _status(etcd_server.endpoint, run_id)
    assert final["progress"]["step"] == steps
    logs = {node: (tmp_path / f"{node}.log").read_text() for node in agents}
    # ranks follow registration order, so rank 1 (the one that stalls) is on either node
    stalled_node = "a" if "hang: rank 1 on a completed no step" in logs["a"] else "b"
    peer = "b" if stalled_node == "a" else "a"
    assert f"hang: rank 1 on {stalled_node} completed no step" in logs[stalled_node]
    assert "in train_step" in logs[stalled_node]  # its stack shows where it is stuck
    assert f"hang: rank 0 on {peer} completed no step" in logs[peer]  # its peer waits for it
    stalled = [e for e in events(tmp_path / "events.jsonl") if e.name == "step.stalled"]
    assert {e.rank for e in stalled if e.step == 24} == {0, 1}


def _cause(round_: int, error: str = "ValueError: bad") -> RootCause:
    return RootCause(round=round_, rank=1, node="b", host="h-b", time_ms=0, exitcode=1,
                     error=error, traceback='  File "train.py", line 3, in main\n')


def test_the_run_keeps_one_cause_per_failure_and_a_repeat_ends_the_job(
    etcd_kv: EtcdKV, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    registry = RunRegistry(etcd_kv, run_id)
    with caplog.at_level("ERROR"):
        assert report_root_cause(registry, _cause(1, error=""), claimed=True) is None
        assert report_root_cause(registry, _cause(1), claimed=False) is None  # exception wins
        assert report_root_cause(registry, _cause(1, "KeyError: x"), claimed=True) is None
        assert report_root_cause(registry, _cause(2, error=""), claimed=False) is None
    assert registry.root_cause()[0] == _cause(1)
    assert caplog.text.count("Root Cause") == 2  # the exit code, then the exception
    verdict = report_root_cause(registry, _cause(2), claimed=True)
    assert isinstance(verdict, Failed) and "not retried again" in verdict.reason
    assert registry.root_cause()[0] == _cause(2)
