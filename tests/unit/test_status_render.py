"""``elastic-rt status`` decoding the keys the runtime and agents write: step, rate, cause."""

from __future__ import annotations

import json

from elastic_rt.rendezvous.kv import KeyValue
from elastic_rt.rendezvous.rounds import NodeInfo, Round
from elastic_rt.root_cause import RootCause
from elastic_rt.ops.status import render, status_from_keys

CAUSE = RootCause(round=2, rank=3, node="node-b", host="10.0.0.2", time_ms=0, exitcode=1,
                  error="ValueError: bad", step=40,
                  traceback='Traceback:\n  File "train.py", line 9, in step\n    raise\n')


def _items(**values: bytes) -> dict[str, KeyValue]:
    return {name: KeyValue(name, value, 5, 5, 0) for name, value in values.items()}


def test_step_rate_budget_and_root_cause_are_shown() -> None:
    items = _items(progress=json.dumps({"round": 2, "step": 120, "steps_per_s": 3.5,
                                        "ms": 1_700_000_000_000}).encode(),
                   restarts=b"1", max_restarts=b"3", root_cause=CAUSE.to_json())
    status = status_from_keys("r", items, endpoint="e", now_ms=0)
    text = render(status)
    assert "step        120  (3.50 steps/s" in text
    assert "restarts    1 used, 2 left of 3" in text
    assert "root cause  rank 3 on 10.0.0.2 (node-b) at step 40: ValueError: bad (round 2)" in text
    assert 'File "train.py", line 9, in step' in text
    assert status.root_cause is not None and status.root_cause["traceback"] == CAUSE.traceback


def test_a_run_without_steps_or_failures_says_so() -> None:
    text = render(status_from_keys("r", _items(progress=b"garbage"), endpoint="e", now_ms=0))
    assert "step        none completed yet" in text and "root cause" not in text


def _node(node_id: str) -> bytes:
    return json.dumps({"node_id": node_id, "host": "10.0.0.9", "nproc": 1}).encode()


def test_a_node_waiting_beside_a_full_round_is_a_spare() -> None:
    full = Round(number=1, members=("a", "b"), nprocs=(1, 1), hosts=("h", "h"))
    items = _items(round=full.to_json(), max_nodes=b"2", **{
        "nodes/a": _node("a"), "nodes/b": _node("b"), "nodes/c": _node("c")})
    states = {n.node_id: n.state for n in status_from_keys("r", items, endpoint="e",
                                                           now_ms=0).nodes}
    assert states == {"a": "in round", "b": "in round", "c": "spare"}
    items["max_nodes"] = KeyValue("max_nodes", b"3", 5, 5, 0)  # room for c: it is admitted next
    states = {n.node_id: n.state for n in status_from_keys("r", items, endpoint="e",
                                                           now_ms=0).nodes}
    assert states["c"] == "waiting"


def test_an_uneven_split_of_the_current_round_names_the_stragglers() -> None:
    current = Round(number=4, members=("a", "b", "c"), nprocs=(1, 1, 1), hosts=("h",) * 3)
    shares = {"round": 4, "step": 80, "nodes": ["a", "b", "c"], "weights": [1000, 900, 300]}
    items = _items(round=current.to_json(), shares=json.dumps(shares).encode())
    text = render(status_from_keys("r", items, endpoint="e", now_ms=0))
    assert "stragglers  c 14%, b 41%, a 45% of each global batch (since step 80)" in text
    shares["round"] = 3  # an older round's split: this one splits evenly again
    items = _items(round=current.to_json(), shares=json.dumps(shares).encode())
    assert "stragglers" not in render(status_from_keys("r", items, endpoint="e", now_ms=0))


def test_a_pending_preemption_is_shown_on_the_run_and_its_node() -> None:
    round_ = Round(number=3, members=("a", "b", "c"), nprocs=(1, 1, 1), hosts=("h",) * 3)
    record = {"source": "http://169.254.169.254/preempted", "detail": "TRUE", "since_ms": 1_000,
              "deadline_ms": 21_000, "at_boundary": True}
    items = _items(round=round_.to_json(), **{"leaving/c": json.dumps(record).encode()},
                   **{f"nodes/{n}": NodeInfo(node_id=n, host="h", nproc=1).to_json()
                      for n in "abc"})
    status = status_from_keys("r", items, endpoint="e", now_ms=2_500)
    assert status.state == "running (c leaving at the next step boundary)"
    assert status.leaving["c"]["leaves_in_s"] == 18.5
    states = {n.node_id: n.state for n in status.nodes}
    assert states == {"a": "in round", "b": "in round", "c": "leaving (http://169.254.169.254/"
                      "preempted; at the next step boundary, at once in 18.5 s)"}
    assert states["c"] in render(status)
