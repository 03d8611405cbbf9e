"""Hung and killed nodes with a 10-minute collective timeout: recovered in place.

NCCL never fails a collective whose peer died or hung, it blocks; gloo blocks the
same way on a SIGSTOPped peer. So these jobs run with the workers' collective
timeout at 10 minutes and the lease TTL at 30 s: neither may be what frees the
survivors. The agents' heartbeats evict the silent node, the new round's notice
cuts the survivors' blocked collectives short, and they re-form and retry the step.
The second test runs a job beside CPU hogs and checks that no healthy node is
evicted when the box is loaded.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_rt.config import COLLECTIVE_TIMEOUT_ENV
from elastic_rt.harness import REPO, child_env, wait_until
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, exit_code, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(420)]

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
STEPS = 250
"""Enough that training outlasts d's fencing: a woken agent learns of it at its next lease
renewal, up to TTL/4 = 7.5 s later (with 100 steps the job once finished first)."""
LEASE_TTL = "30"
"""Far longer than any recovery here may take: the lease must not be what helps."""
TEN_MINUTES = "600"


def _node(tree: ProcessTree, endpoint: str, run_id: str, tmp: Path, name: str, nnodes: str,
          steps: int = STEPS, *pace: str) -> subprocess.Popen[bytes]:
    args = launch_args(endpoint, run_id, nnodes, tmp / "events.jsonl", node_id=name,
                       extra=("--lease-ttl", LEASE_TTL))
    script = [SCRIPT, "--steps", str(steps), "--out", str(tmp / "params.pt"),
              "--step-time", "0.05", *pace]
    env = child_env(**{COLLECTIVE_TIMEOUT_ENV: TEN_MINUTES})
    return tree.elastic_rt(*args, *script, env=env, log=str(tmp / f"{name}.log"))


def _steps(tmp: Path) -> list[int]:
    return [e.step or 0 for e in events(tmp / "events.jsonl") if e.name == "step.completed"]


def _trained_without(tmp: Path, node: str, *, after_round: int) -> bool:
    """A step was completed in a round after ``after_round`` that ``node`` is not in."""
    log = events(tmp / "events.jsonl")
    without = {e.round for e in log if e.name == "round.formed" and e.source == "agent"
               and (e.round or 0) > after_round and node not in e.metadata.get("members", ())}
    return any(e.name == "step.completed" and e.round in without for e in log)


def _round_now(tmp: Path) -> int:
    return max((e.round or 0) for e in events(tmp / "events.jsonl") if e.name == "step.completed")


def _log(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")[-3000:]


def test_a_hung_and_a_killed_node_cost_no_step_and_change_no_parameter(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    released = tmp_path / "pace-released"  # slow steps only until both faults are behind
    pace = ("--step-time-until", str(released))
    reference = _node(process_tree, etcd_server.endpoint, run_id + "-ref", reference_dir,
                      "solo", "1", STEPS, *pace)
    nodes = {n: _node(process_tree, etcd_server.endpoint, run_id, tmp_path, n, "2:4", STEPS,
                      *pace) for n in "abcd"}

    # d hangs mid-run: its lease has 30 s left and the collectives wait 10 minutes.
    wait_until(lambda: max(_steps(tmp_path), default=0) >= 25, 240, "step 25")
    hung_round = _round_now(tmp_path)
    process_tree.signal_tree(nodes["d"].pid, signal.SIGSTOP)
    wait_until(lambda: _trained_without(tmp_path, "d", after_round=hung_round), 15,
               "a step without d, well within its lease TTL and the collective timeout")
    # When it wakes it finds itself fenced: its workers stop and it joins again as a new node.
    process_tree.signal_tree(nodes["d"].pid, signal.SIGCONT)
    wait_until(lambda: any(e.name == "agent.fenced" and e.node == "d"
                           for e in events(tmp_path / "events.jsonl")), 60, "d fenced")

    # then c is killed outright.
    killed_round = _round_now(tmp_path)
    process_tree.signal_tree(nodes["c"].pid, signal.SIGKILL)
    wait_until(lambda: _trained_without(tmp_path, "c", after_round=killed_round), 15,
               "a step without c")
    released.touch()

    for name in "ab":
        code = exit_code(nodes[name], 240, tmp_path / f"{name}.log", tmp_path / "events.jsonl")
        assert code == 0, _log(tmp_path, name)
    assert reference.wait(timeout=120) == 0, _log(reference_dir, "solo")
    got, want = torch.load(tmp_path / "params.pt"), torch.load(reference_dir / "params.pt")
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)

    log = events(tmp_path / "events.jsonl")
    evicted = [(e.metadata["evicted"], e.metadata["liveness"]) for e in log
               if e.name == "node.evicted"]
    assert ("d", "unknown") in evicted, evicted  # found silent by its ring neighbour
    assert [e for e in log if e.name == "worker.restarted" and e.node in ("a", "b")] == []
    for survivor in "ab":  # 0 steps lost: every step done once, none skipped
        steps = sorted(e.step for e in log if e.name == "step.completed" and e.node == survivor
                       and e.step is not None)
        assert steps == list(range(1, STEPS + 1)), f"{survivor} skipped a step or did one twice"


HOGS = 4
"""Busy processes beside the job: twice this machine's 2 cores."""


def test_no_healthy_node_is_evicted_beside_cpu_hogs(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    hog = [sys.executable, "-c", "while True: pass"]
    for i in range(HOGS):
        process_tree.start(hog, log=tmp_path / f"hog-{i}.log")
    steps = 60
    nodes = {n: _node(process_tree, etcd_server.endpoint, run_id, tmp_path, n, "3", steps=steps)
             for n in "abc"}
    for name, proc in nodes.items():
        assert proc.wait(timeout=300) == 0, _log(tmp_path, name)
    log = events(tmp_path / "events.jsonl")
    assert max(e.step or 0 for e in log if e.name == "step.completed") == steps
    lost = [e for e in log if e.name in ("node.evicted", "node.lost", "agent.fenced")]
    assert lost == [], lost
