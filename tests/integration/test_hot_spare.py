"""A spare: a node started beyond ``--nnodes MAX`` waits registered, workers imported and
its model built, and replaces a lost member in the round that drops it.

Two members (``--nnodes 2:2``) train; node c starts beyond the maximum and waits as a
spare. When b is SIGKILLed the job never shrinks: the round without b already admits
c, whose state streams from a while a trains. The run ends with the parameters of an
uninterrupted run, every step done once by the survivor.

When the spare's own worker is SIGKILLed instead, its agent replaces just that worker
in standby (a restart of the job's budget) and the members train on in their round,
with no re-form (docs/soak.md, finding 7).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from elastic_rt.events import Event
from elastic_rt.harness import wait_until
from elastic_rt.rendezvous.rounds import SPARE
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import (events, exit_code, latest_step,
                                              release_pace_when_training, train_node)

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

STEPS = 300


def _node(tree: ProcessTree, endpoint: str, run_id: str, tmp: Path, name: str, nnodes: str,
          steps: int = STEPS, *pace: str):
    return train_node(tree, endpoint, run_id, tmp, name, nnodes, "--steps", str(steps),
                      "--step-time", "0.05", *pace)


def _is_spare(e: Event) -> bool:
    return e.name == "node.waiting" and e.node == "c" and e.metadata["reason"] == SPARE


def test_a_spare_replaces_a_lost_member_without_the_job_shrinking(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    # slow steps only until c has taken b's place: the rest of the job runs at full speed
    released = tmp_path / "pace-released"
    pace = ("--step-time-until", str(released))
    reference = _node(process_tree, etcd_server.endpoint, run_id + "-ref", reference_dir,
                      "solo", "1", STEPS, *pace)
    nodes = {n: _node(process_tree, etcd_server.endpoint, run_id, tmp_path, n, "2:2", STEPS,
                      *pace) for n in "ab"}
    wait_until(lambda: latest_step(tmp_path / "events.jsonl") >= 10, 180, "step 10")
    nodes["c"] = _node(process_tree, etcd_server.endpoint, run_id, tmp_path, "c", "2:2",
                       STEPS, *pace)
    log = tmp_path / "events.jsonl"
    wait_until(lambda: any(e.name == "node.waiting" and e.node == "c"
                           and e.metadata["reason"] == SPARE for e in events(log)), 120,
               "c registered and waiting as a spare, its workers started")
    killed = process_tree.signal_tree(nodes["b"].pid, signal.SIGKILL)
    release_pace_when_training(log, released, "c", since=lambda e: e.timestamp_ms / 1000 >= killed)
    for name in "ac":
        assert exit_code(nodes[name], 240, tmp_path / f"{name}.log", log) == 0
    assert reference.wait(timeout=120) == 0
    got, want = torch.load(tmp_path / "params.pt"), torch.load(reference_dir / "params.pt")
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)

    seen = events(log)
    sizes = {e.metadata["world_size"] for e in seen if e.name == "step.completed"}
    assert sizes == {2}, f"the job shrank: world sizes {sizes}"
    formed = [e.metadata["members"] for e in seen
              if e.name == "round.formed" and e.source == "agent"]
    assert formed[-1] == ["a", "c"], formed  # c took b's place in the round that dropped b
    steps = sorted(e.step for e in seen if e.name == "step.completed" and e.node == "a"
                   and e.step is not None)
    assert steps == list(range(1, STEPS + 1)), "a skipped a step or did one twice"


def test_a_spares_killed_worker_is_replaced_in_standby_without_disturbing_the_members(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    steps = 2000  # 0.05 s each: the members train on while c's replacement imports torch
    log = tmp_path / "events.jsonl"
    nodes = {n: _node(process_tree, etcd_server.endpoint, run_id, tmp_path, n, "2:2", steps)
             for n in "ab"}
    wait_until(lambda: latest_step(log) >= 10, 180, "step 10")
    nodes["c"] = _node(process_tree, etcd_server.endpoint, run_id, tmp_path, "c", "2:2", steps)
    wait_until(lambda: any(_is_spare(e) for e in events(log)), 120, "c waiting as a spare")
    (started,) = [e for e in events(log) if e.name == "worker.started" and e.node == "c"]
    process_tree.tree(nodes["c"].pid)  # remembered for the final sweep
    process_tree.signal_tree(started.metadata["pids"][0], signal.SIGKILL)
    killed_at = latest_step(log)

    def waiting_again() -> bool:
        seen = events(log)
        restarted = [e for e in seen if e.name == "worker.restarted" and e.node == "c"]
        return bool(restarted) and any(_is_spare(e) and e.timestamp_ms > restarted[0].timestamp_ms
                                       for e in seen)
    wait_until(waiting_again, 120, "c's worker replaced and c waiting as a spare again")
    back_at = latest_step(log)
    for name in "abc":
        process_tree.signal_tree(nodes[name].pid, signal.SIGKILL)  # the rest is not the point

    seen = events(log)
    (restarted,) = [e for e in seen if e.name == "worker.restarted" and e.node == "c"]
    assert restarted.metadata["standby"] and restarted.metadata["restart_count"] == 1
    formed = [e for e in seen if e.name == "round.formed" and e.source == "agent"]
    assert [sorted(e.metadata["members"]) for e in formed] == [["a", "b"]], \
        f"the members re-formed: {[e.metadata for e in formed]}"
    assert not [e for e in seen if e.name == "groups.reformed" and e.round != 0]
    assert back_at - killed_at >= 20, f"the members stood still: steps {killed_at}-{back_at}"
