"""Preemption notices end to end: a node told it will go leaves at a step boundary.

Three ``elastic-rt launch`` nodes with one gloo worker each. Node c is warned mid-run, once by
a cloud-style metadata endpoint (a local HTTP server in the test flips ``preempted`` for c),
once by SIGTERM with a grace period (Kubernetes, Slurm). c's workers finish the step they are
in, every rank stops after that same step, c's state goes where the others restore it from
(replicas hold it all; under FSDP c's shards go to peer copies of that very step, and a
checkpoint in flight commits first), and c leaves. The survivors pause for one re-form: no
step fails or is redone, every step is done exactly once, and the final parameters equal an
uninterrupted run's (1e-5).
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch

from elastic_rt.events import Event
from elastic_rt.harness import REPO, child_env, wait_until
from scripts.examples import elastic_train, fsdp_train
from tests.fixtures.fsdp_reference import reference_params, train_alone
from tests.fixtures.local_http import serving
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, exit_code, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(240)]

STEPS, NOTICE_AT, GLOBAL_BATCH, WIDTH, HIDDEN = 50, 20, 12, 32, 64
SURVIVORS = ("a", "b")


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A cloud metadata endpoint per node: ``/<node>`` says ``{"preempted": false}`` until
    the test flips it."""

    preempted: set[str] = set()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        node = self.path.strip("/")
        body = b'{"preempted": %s}' % (b"true" if node in type(self).preempted else b"false")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def metadata() -> Iterator[tuple[str, set[str]]]:
    """The endpoint's base URL and the set of preempted nodes; stopped in teardown."""
    preempted: set[str] = set()
    with serving(type("Handler", (_Metadata,), {"preempted": preempted})) as url:
        yield url, preempted


def _step(log: list[Event]) -> int:
    return max((e.step or 0 for e in log if e.name == "step.completed"), default=0)


def _start(tree: ProcessTree, endpoint: str, run_id: str, tmp: Path, script: list[str],
           extra: dict[str, list[str]]) -> dict[str, subprocess.Popen[bytes]]:
    nodes = {}
    for name in ("a", "b", "c"):
        args = launch_args(endpoint, run_id, "2:3", tmp / "events.jsonl", node_id=name,
                           extra=tuple(extra.get(name, [])))
        nodes[name] = tree.elastic_rt(*args, *script, env=child_env(),
                                      log=str(tmp / f"{name}.log"))
    return nodes


def _assert_left_at_a_boundary(log: list[Event], *, source: str) -> int:
    """c left after one step, every rank agreed on it, and the survivors did every step
    once, none failed, and re-formed once without c; returns the step c left after."""
    (preempting,) = [e for e in log if e.name == "node.preempting"]
    assert preempting.node == "c" and preempting.metadata["at_boundary"] is True
    assert preempting.metadata["source"].startswith(source), preempting
    (left,) = [e for e in log if e.name == "node.left"]
    assert left.node == "c" and left.metadata["at_boundary"] is True, left
    step = left.step
    assert step is not None and NOTICE_AT <= step < STEPS
    agreed = [e for e in log if e.name == "leave.agreed"]
    assert sorted(str(e.node) for e in agreed) == ["a", "b", "c"], agreed
    assert {e.step for e in agreed} == {step}  # every rank stopped after the same step
    assert [e.node for e in agreed if e.metadata["leaving"]] == ["c"]
    formed = [e for e in log if e.name == "round.formed" and e.node == "c"
              and e.metadata.get("world_size") == 2]
    assert len(formed) == 1 and formed[0].metadata["reason"].startswith(f"left c after step "
                                                                        f"{step}"), formed
    retried = [e for e in log if e.name == "step.retried"]
    assert not retried, retried  # nobody's collective was cut short
    assert not [e for e in log if e.name == "worker.restarted"], "recovery was not in-process"
    for survivor in SURVIVORS:
        steps = sorted(e.step or 0 for e in log
                       if e.name == "step.completed" and e.node == survivor)
        assert steps == list(range(1, STEPS + 1)), f"{survivor} skipped or redid a step"
        sizes = [e.metadata["world_size"] for e in log if e.name == "step.completed"
                 and e.node == survivor and e.step == step + 1]
        assert sizes == [2], sizes  # the step after the leave is the new round's
    c_steps = [e.step or 0 for e in log if e.name == "step.completed" and e.node == "c"]
    assert max(c_steps) == step, "c trained past the step it left after"
    reforms = [(e.node, e.round) for e in log if e.name == "groups.reformed"
               and e.node in SURVIVORS and (e.round or 0) > 0]
    assert sorted(reforms) == [("a", 1), ("b", 1)], reforms  # the pause is one re-form
    resumed = [e for e in log if e.name == "step.resumed" and e.node in SURVIVORS]
    assert {e.step for e in resumed} == {step + 1} and len(resumed) == 2, resumed
    print(f"c left after step {step}; survivors' pause (to their next completed step): "
          f"{[e.metadata['downtime_ms'] for e in resumed]} ms")
    return step


def test_a_cloud_notice_makes_a_replica_leave_at_a_step_boundary_with_nothing_redone(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path,
    metadata: tuple[str, set[str]],
) -> None:
    url, preempted = metadata
    out = tmp_path / "params.pt"
    script = [str(REPO / "scripts" / "examples" / "elastic_train.py"), "--steps", str(STEPS),
              "--step-time", "0.05", "--global-batch", str(GLOBAL_BATCH), "--out", str(out)]
    nodes = _start(process_tree, etcd_server.endpoint, run_id, tmp_path, script,
                   {"c": ["--preemption-notice", f"{url}/c"]})
    wait_until(lambda: _step(events(tmp_path / "events.jsonl")) >= NOTICE_AT, 150,
               f"step {NOTICE_AT}")
    preempted.add("c")
    codes = {n: exit_code(p, 120, tmp_path / f"{n}.log", tmp_path / "events.jsonl")
             for n, p in nodes.items()}
    assert codes == {"a": 0, "b": 0, "c": 0}, codes  # a notice's leave is no error

    log = events(tmp_path / "events.jsonl")
    _assert_left_at_a_boundary(log, source=f"{url}/c")
    restored = [e for e in log if e.name == "state.restored" and e.node in SURVIVORS
                and e.round == 1]
    assert [(e.metadata["source"], e.metadata["bytes_moved"]) for e in restored] == \
        [("kept", 0)] * 2, restored  # the replicas hold the state: 0 bytes moved

    data = elastic_train.Regression(n=GLOBAL_BATCH * 50, width=WIDTH)
    torch.manual_seed(0)  # the script's build
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, 1))
    want = train_alone(model, data, steps=STEPS, global_batch=GLOBAL_BATCH)
    got = torch.load(out)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)


def test_sigterm_makes_an_fsdp_node_hand_its_shards_over_and_leave_with_nothing_redone(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    script = [str(REPO / "scripts" / "examples" / "fsdp_train.py"), "--steps", str(STEPS),
              "--step-time", "0.05", "--global-batch", str(GLOBAL_BATCH), "--max-shard", "64",
              "--out", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt"),
              "--every", "1"]  # a save every step: one is in flight at the boundary
    nodes = _start(process_tree, etcd_server.endpoint, run_id, tmp_path, script,
                   {"c": ["--leave-timeout", "60"]})
    wait_until(lambda: _step(events(tmp_path / "events.jsonl")) >= NOTICE_AT, 150,
               f"step {NOTICE_AT}")
    os.kill(nodes["c"].pid, signal.SIGTERM)  # the agent alone, as Kubernetes signals PID 1
    codes = {n: exit_code(p, 120, tmp_path / f"{n}.log", tmp_path / "events.jsonl")
             for n, p in nodes.items()}
    assert codes == {"a": 0, "b": 0, "c": 128 + signal.SIGTERM}, codes

    log = events(tmp_path / "events.jsonl")
    step = _assert_left_at_a_boundary(log, source="SIGTERM")
    restored = {e.metadata["source"] for e in log
                if e.name == "state.restored" and e.node in SURVIVORS and e.round == 1}
    assert restored == {"peer copies"}, restored  # c's shards, of the very step it left after
    committed = [e.step for e in log if e.name == "checkpoint.committed" and e.round == 0]
    assert step in committed, committed  # the save in flight at the boundary committed

    got = fsdp_train.join_params(str(tmp_path / "out"))
    want = reference_params(steps=STEPS, global_batch=GLOBAL_BATCH, width=WIDTH, hidden=HIDDEN)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)
