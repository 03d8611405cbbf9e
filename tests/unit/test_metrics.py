"""The agent's Prometheus figures, folded from events (agents.metrics)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from pathlib import Path
from urllib.request import urlopen

import pytest

from agents.metrics import MetricsServer, NodeMetrics, recovery_cause
from elastic_rt.errors import ConfigError
from elastic_rt.harness import PYTHON
from elastic_rt.rendezvous.rounds import Round


def _round(number: int, reason: str, members: tuple[str, ...] = ("a", "b"),
           restarts: int = 0) -> Round:
    return Round(number=number, members=members, nprocs=(2,) * len(members),
                 hosts=("127.0.0.1",) * len(members), reason=reason, restarts=restarts)


def _step(step: int, round_: int, at_ms: int, node: str = "a", rank: int = 0) -> dict:
    return {"name": "step.completed", "run_id": "r", "node": node, "rank": rank,
            "round": round_, "step": step, "timestamp_ms": at_ms, "metadata": {}}


def _value(metrics: NodeMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"run_id": "r", "node": "a", **labels})


@pytest.mark.parametrize("number,reason,cause", [
    (0, "all nodes joined", "start"), (3, "lost c", "node_lost"),
    (4, "admitting d", "node_joined"), (5, "paused: 1 of at least 2 nodes left", "paused"),
    (6, "a worker failed on b", "worker_failure"),
    (7, "left c after step 41 (SIGTERM)", "node_left"),
])
def test_a_round_reason_becomes_a_cause_with_few_values(number, reason, cause) -> None:
    assert recovery_cause(_round(number, reason)) == cause


def test_a_kill_is_one_recovery_with_the_gap_between_steps_and_the_redone_steps() -> None:
    metrics = NodeMetrics("r", "a", max_restarts=3)
    metrics.saw_round(_round(0, "all nodes joined", ("a", "b", "c")))
    for step in (1, 2, 3):
        for rank in (0, 1):  # two local workers: each step counted once
            metrics.observe(_step(step, 0, 1000 * step, rank=rank))
    metrics.observe(_step(3, 0, 3000, node="b"))  # another node's line in a shared file
    # The workers are ahead of the agent: the cause arrives with the round.
    metrics.observe(_step(3, 1, 5500))
    assert _value(metrics, "elastic_rt_recoveries_total", cause="node_lost") is None
    metrics.saw_round(_round(1, "lost c"))
    metrics.observe(_step(4, 1, 6000))
    assert _value(metrics, "elastic_rt_steps_completed_total") == 4
    assert _value(metrics, "elastic_rt_steps_redone_total") == 1
    assert _value(metrics, "elastic_rt_recoveries_total", cause="node_lost") == 1
    assert _value(metrics, "elastic_rt_recovery_downtime_seconds_sum", cause="node_lost") == 2.5
    assert _value(metrics, "elastic_rt_members") == 2
    assert _value(metrics, "elastic_rt_rounds_total") == 2
    assert _value(metrics, "elastic_rt_restarts_left") == 3
    metrics.saw_round(_round(2, "a worker failed on b", restarts=1))
    assert _value(metrics, "elastic_rt_restarts_left") == 2


def test_checkpoints_restores_and_evictions_are_counted_once_per_node() -> None:
    metrics = NodeMetrics("r", "a", max_restarts=3)
    base = {"run_id": "r", "node": "a", "round": 1, "step": 10, "timestamp_ms": 0}
    metrics.observe({**base, "name": "checkpoint.committed",
                     "metadata": {"nbytes": 1000, "write_ms": 250, "blocking_ms": 5}})
    for rank in (0, 1):
        metrics.observe({**base, "rank": rank, "name": "checkpoint.restored",
                         "metadata": {"checkpoint": "c10", "nbytes": 1000, "duration_ms": 100}})
        metrics.observe({**base, "rank": rank, "name": "state.restored",
                         "metadata": {"source": "replica", "bytes_moved": 64}})
    metrics.observe({**base, "name": "node.evicted", "metadata": {}})
    assert _value(metrics, "elastic_rt_checkpoint_saves_total") == 1
    assert _value(metrics, "elastic_rt_checkpoint_saved_bytes_total") == 1000
    assert _value(metrics, "elastic_rt_checkpoint_save_seconds_sum") == 0.25
    assert _value(metrics, "elastic_rt_checkpoint_loads_total") == 1
    assert _value(metrics, "elastic_rt_checkpoint_load_seconds_count") == 2  # per worker
    assert _value(metrics, "elastic_rt_state_restores_total", source="replica") == 1
    assert _value(metrics, "elastic_rt_state_restored_bytes_total") == 128
    assert _value(metrics, "elastic_rt_heartbeat_evictions_total") == 1
    assert _value(metrics, "elastic_rt_restarts_left") == 3  # no round read yet: the whole budget


def test_the_server_follows_the_events_file_and_serves_it(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps(_step(7, 0, 1)) + "\n")
    server = MetricsServer(NodeMetrics("r", "a", max_restarts=3), str(events), port=0)
    try:
        server.poll()
        with urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert 'elastic_rt_step{node="a",run_id="r"} 7.0' in text
    finally:
        server.close()


def test_a_port_in_use_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--metrics-port {port}"):
            MetricsServer(NodeMetrics("r", "a", max_restarts=3), str(tmp_path / "e.jsonl"),
                          port=port)
        done = subprocess.run([PYTHON, "-m", "elastic_rt.cli", "launch", "--standalone",
                               "--metrics-port", str(port), str(script)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert f"--metrics-port {port}" in done.stderr, done.stderr


def test_the_grafana_dashboard_queries_only_series_the_agent_serves() -> None:
    from elastic_rt.harness import REPO

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    served = {family.name + suffix
              for family in NodeMetrics("r", "a", max_restarts=3).registry.collect()
              for suffix in suffixes[family.type]}
    dashboard = json.loads((REPO / "scripts" / "cluster" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"elastic_rt_[a-z_]+", target["expr"])}
    assert queried and queried <= served, queried - served
