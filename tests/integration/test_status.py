"""``elastic-rt status`` against a real etcd holding keys written the registry's way."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from elastic_rt.cli import main
from elastic_rt.config import EtcdAuth
from elastic_rt.errors import EndpointUnreachableError, UnknownRunError
from elastic_rt.etcd_server import free_port
from elastic_rt.events import EventSink
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import NodeInfo, Propose, Round
from elastic_rt.ops.status import show_status

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def _status(endpoint: str, run_id: str, *, events_file: str | None = None) -> str:
    return show_status(endpoint, run_id, auth=EtcdAuth(), events_file=events_file, as_json=False)


def _json(endpoint: str, run_id: str) -> dict:
    text = show_status(endpoint, run_id, auth=EtcdAuth(), events_file=None, as_json=True)
    return json.loads(text)


def _running_run(kv: EtcdKV, run_id: str) -> RunRegistry:
    """Nodes a, b in round 1 (c was lost), d waiting, one restart counted, layout and checkpoint."""
    registry = RunRegistry(kv, run_id)
    lease = kv.grant_lease(30)
    for node in ("a", "b", "c"):
        registry.register(NodeInfo(node, f"10.0.0.{ord(node) - 96}", 2), lease)
    now = int(time.time() * 1000)
    first = registry.propose(
        Propose(Round(0, ("a", "b", "c"), (2, 2, 2), ("10.0.0.1", "10.0.0.2", "10.0.0.3"),
                      "all nodes joined", now - 60_000), 0))  # fmt: skip
    assert first is not None
    kv.delete(registry.key("nodes/c"))
    second = registry.propose(
        Propose(Round(1, ("a", "b"), (2, 2), ("10.0.0.1", "10.0.0.2"), "lost c", now - 5_000),
                first.token))  # fmt: skip
    assert second is not None
    registry.register(NodeInfo("d", "10.0.0.4", 2), lease)
    registry.count_restart()
    kv.put(registry.key("max_restarts"), b"3")
    layout = {"round": 1, "layout": {"dp": 2, "pp": 2, "tp": 1}}
    kv.put(registry.key("layout"), json.dumps(layout).encode())
    registry.commit_fenced("checkpoint", json.dumps(
        {"name": "step-000120", "step": 120, "url": "s3://bucket/llm/step-000120"}).encode(),
        second.token)  # fmt: skip
    return registry


def test_text_shows_round_nodes_layout_checkpoint_and_budget(etcd_server, etcd_kv, run_id) -> None:
    _running_run(etcd_kv, run_id)
    text = _status(etcd_server.endpoint, run_id)
    assert f"run         {run_id}  (running)" in text
    assert "round       1  (lost c)  token" in text and "formed 5 s ago" in text
    assert "world size  4 workers on 2 nodes" in text
    assert "layout      dp=2 pp=2 tp=1" in text
    assert "checkpoint  step-000120  step 120  s3://bucket/llm/step-000120" in text
    assert "restarts    1 used, 2 left of 3" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[7:] if line}
    assert rows["a"] == ["10.0.0.1", "2", "0", "in", "round"]
    assert rows["b"][2] == "1"
    assert rows["d"] == ["10.0.0.4", "2", "-", "waiting"]
    assert "c" not in rows


def test_json_carries_the_same_facts(etcd_server, etcd_kv, run_id) -> None:
    _running_run(etcd_kv, run_id)
    data = _json(etcd_server.endpoint, run_id)
    assert data["state"] == "running"
    assert data["round"]["number"] == 1 and data["round"]["world_size"] == 4
    assert data["round"]["members"] == ["a", "b"] and data["round"]["token"] > 0
    assert [(n["node_id"], n["group_rank"], n["state"]) for n in data["nodes"]] == [
        ("a", 0, "in round"), ("b", 1, "in round"), ("d", None, "waiting")]  # fmt: skip
    assert data["layout"]["layout"] == {"dp": 2, "pp": 2, "tp": 1}
    assert data["checkpoint"]["step"] == 120
    assert (data["restarts_used"], data["max_restarts"], data["restarts_left"]) == (1, 3, 2)


def test_member_whose_key_expired_shows_as_gone_and_run_as_re_forming(
    etcd_server, etcd_kv, run_id
) -> None:
    registry = _running_run(etcd_kv, run_id)
    etcd_kv.delete(registry.key("nodes/b"))
    data = _json(etcd_server.endpoint, run_id)
    assert data["state"] == "re-forming (lost b)"
    assert data["nodes"][1]["state"] == "gone"


def test_finished_and_failed_runs_say_so(etcd_server, etcd_kv, run_id) -> None:
    registry = _running_run(etcd_kv, run_id)
    registry.mark_completing()
    assert "(finishing)" in _status(etcd_server.endpoint, run_id)
    registry.close("failed: worker 0 on a exited with 1; the restart budget of 3 is spent")
    text = _status(etcd_server.endpoint, run_id)
    assert "(failed: worker 0 on a exited with 1; the restart budget of 3 is spent)" in text


def test_events_file_adds_recoveries_and_last_events(
    etcd_server, etcd_kv, run_id, tmp_path: Path
) -> None:
    _running_run(etcd_kv, run_id)
    path = str(tmp_path / "events.jsonl")
    sink = EventSink(path, source="agent", run_id=run_id, node="a")
    sink.emit("round.formed", round=0, world_size=6, members=["a", "b", "c"], reason="all joined")
    sink.emit("worker.failed", round=0, local_rank=0, exitcode=1)
    sink.emit("node.lost", round=1, lost="c")
    sink.emit("round.formed", round=1, world_size=4, members=["a", "b"], reason="lost c")
    sink.emit("worker.restarted", round=1, world_size=4, restart_count=1)
    text = _status(etcd_server.endpoint, run_id, events_file=path)
    assert "recovery  round 1: lost c, world 6 -> 4" in text
    assert "node.lost  round 1  lost c" in text
    assert "worker.failed  round 0  local rank 0 exit 1" in text


def test_unknown_run_id_is_one_line_naming_the_runs_that_exist(
    fresh_etcd, run_id, capsys
) -> None:
    # A fresh etcd: the session's one holds other tests' runs, and the list is cut short.
    etcd_server = fresh_etcd
    etcd_kv = EtcdKV(etcd_server.endpoint)
    _running_run(etcd_kv, run_id)
    etcd_kv.close()
    with pytest.raises(UnknownRunError, match=f"no run 'nope' on etcd.*{run_id}"):
        _status(etcd_server.endpoint, "nope")
    argv = ["status", "--run-id", "nope", "--rdzv-endpoint", f"etcd://{etcd_server.endpoint}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-rt: error: no run 'nope'") and "\n" not in err


def test_status_reads_no_launch_setting_from_the_environment(
    etcd_server, etcd_kv, run_id, monkeypatch, capsys
) -> None:
    """A fractional lease TTL in the environment is launch's business; status just works."""
    _running_run(etcd_kv, run_id)
    monkeypatch.setenv("ELASTIC_RT_LEASE_TTL_SEC", "2.5")
    assert main(["status", "--run-id", run_id, "--rdzv-endpoint", etcd_server.endpoint]) == 0
    assert "round       1  (lost c)" in capsys.readouterr().out


def test_unreachable_etcd_is_one_clear_error() -> None:
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(EndpointUnreachableError, match=f"cannot reach etcd at {endpoint}"):
        _status(endpoint, "any")
