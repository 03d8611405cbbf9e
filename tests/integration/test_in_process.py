"""In-process recovery end to end: workers stay alive through node loss and growth.

Three agents with one gloo worker each run ``scripts/examples/elastic_train.py``.
One node is SIGKILLed at about step 30 and a fourth joins at about step 40; the
final parameters must equal those of an uninterrupted run, the survivors' worker
processes must be the ones that started, and the newcomer's workers must start
before it is admitted (the survivors train on meanwhile). A node that comes back
from a fence is taken back the same way.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

import pytest
import torch

from elastic_rt.etcd_server import free_port
from elastic_rt.events import Event
from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import NodeInfo, Round
from scripts.examples import elastic_train as example
from tests.fixtures.fsdp_reference import train_alone
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import (events, launch_args,
                                              release_pace_when_training, scrape)

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
STEPS = 120
JOIN_STEPS = 500
"""The join test's: d's standby worker (torch imported, model built) took 24 s to be admitted
on 2 busy cores, longer than the survivors' 80 steps after the kill at 120. The steps are slow
(0.05 s) only until d is admitted, so the room costs nothing when d is quick."""
RELEASED = "pace-released"


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str, out: Path,
          nnodes: str = "2:4", steps: int = STEPS, extra: tuple[str, ...] = ()):
    args = launch_args(etcd_server.endpoint, run_id, nnodes, tmp / "events.jsonl", node_id=name,
                       extra=extra)
    script = [SCRIPT, "--steps", str(steps), "--out", str(out), "--step-time", "0.05",
              "--step-time-until", str(tmp / RELEASED)]
    return tree.elastic_rt(*args, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _reference_params(steps: int) -> dict[str, torch.Tensor]:
    """What an uninterrupted run of the example ends with (its defaults: width 32, hidden
    64, global batch 12), trained in this process: no fourth job on the cores beside the
    one under test."""
    return train_alone(example.make_model(32, 64), example.Regression(n=12 * 50, width=32),
                       steps=steps, global_batch=12)


def _step(tmp: Path) -> int:
    return max((e.step or 0 for e in events(tmp / "events.jsonl") if e.name == "step.completed"),
               default=0)


def test_node_kill_and_join_end_with_the_parameters_of_an_uninterrupted_run(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    out = tmp_path / "params.pt"
    metrics_port = free_port()
    nodes = {n: _node(process_tree, etcd_server, run_id, tmp_path, n, out, steps=JOIN_STEPS,
                      extra=("--metrics-port", str(metrics_port)) if n == "a" else ())
             for n in "abc"}
    wait_until(lambda: _step(tmp_path) >= 30, 180, "step 30")
    before = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    os.killpg(nodes["c"].pid, signal.SIGKILL)
    # a's endpoint, read back over loopback: the kill is a recovery with its downtime
    wait_until(lambda: scrape(f"http://127.0.0.1:{metrics_port}/metrics").get(
        ("elastic_rt_recoveries_total", "node_lost"), 0) >= 1, 60, "a's metrics show the kill")
    after = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    # d joins early enough that its workers are imported (seconds on a busy box) before
    # the survivors finish
    wait_until(lambda: _step(tmp_path) >= 40, 120, "step 40 after the kill")
    nodes["d"] = _node(process_tree, etcd_server, run_id, tmp_path, "d", out, steps=JOIN_STEPS)
    release_pace_when_training(tmp_path / "events.jsonl", tmp_path / RELEASED, "d")
    for name in "abd":
        assert nodes[name].wait(timeout=180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    assert before[("elastic_rt_members", "")] == 3 and after[("elastic_rt_members", "")] == 2
    assert after[("elastic_rt_rounds_total", "")] == before[("elastic_rt_rounds_total", "")] + 1
    assert after[("elastic_rt_recovery_downtime_seconds_count", "node_lost")] == 1
    assert 0 < after[("elastic_rt_recovery_downtime_seconds_sum", "node_lost")] < 30
    assert after[("elastic_rt_steps_completed_total", "")] > before[
        ("elastic_rt_steps_completed_total", "")] > 0  # the endpoint lags the events by a poll
    assert after[("elastic_rt_steps_redone_total", "")] == 0
    assert after[("elastic_rt_state_restores_total", "kept")] == 1
    assert after[("elastic_rt_restarts_left", "")] == 3  # a node loss spends no restart

    got, want = torch.load(out), _reference_params(JOIN_STEPS)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)

    log = events(tmp_path / "events.jsonl")
    restarted = [e for e in log if e.name == "worker.restarted" and e.node in ("a", "b")]
    assert restarted == [], "survivors' workers were restarted"
    sizes = {e.metadata["world_size"] for e in log if e.name == "step.completed"}
    assert sizes == {3, 2}, sizes  # 3 nodes, then 2 after the kill, then 3 again with d
    for survivor in "ab":  # by node: the killed node may have been rank 0
        steps = sorted(e.step for e in log if e.name == "step.completed" and e.node == survivor
                       and e.step is not None)
        assert steps == list(range(1, JOIN_STEPS + 1)), \
            f"{survivor} skipped a step or did one twice"

    # nothing moved to the survivors after the kill; d received what they sent, once
    restored = [e for e in log if e.name == "state.restored"]
    kept = [e for e in restored if e.node in ("a", "b") and e.metadata["source"] == "kept"]
    assert {e.node for e in kept} == {"a", "b"} and {e.metadata["bytes_moved"] for e in kept} \
        == {0}, restored
    joined = [e for e in restored if e.node == "d"][-1]
    sent = [e.metadata["bytes_moved"] for e in restored
            if e.node in ("a", "b") and e.round == joined.round]
    assert joined.metadata["bytes_moved"] > 0 and sum(sent) == joined.metadata["bytes_moved"]
    # ... in the next step, which d sat out (a and b trained the whole batch)
    landed = [e for e in log if e.name == "state.landed" and e.round == joined.round]
    assert {e.node for e in landed} == {"a", "b", "d"}, landed
    assert all(e.metadata["receiving"] == [joined.rank]
               and e.metadata["sitting_out"] == [joined.rank] for e in landed), landed

    # d's workers started before d joined, so the survivors trained on meanwhile.
    started = [e for e in log if e.name == "worker.started" and e.node == "d"]
    admitted = [i for i, e in enumerate(log) if e.name == "round.formed" and e.source == "agent"
                and "d" in e.metadata.get("members", ())]
    assert [e.metadata.get("standby") for e in started] == [True], started
    assert admitted and log.index(started[0]) < admitted[0]
    trained_meanwhile = [e for e in log[log.index(started[0]):admitted[0]]
                         if e.name == "step.completed" and e.rank == 0]
    assert trained_meanwhile, "the survivors waited for d's workers to start"


def test_a_node_admitted_as_the_others_finish_ends_with_the_job(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    """Seen in chaos: the round admitting a node formed during the others' last step;
    they finished and left, and its workers waited for a round store that was gone.
    Here ``gone`` is a registered node we control: its round admits ``late``, its
    store address leads nowhere, and once ``late``'s workers wait for it, the job
    completes and ``gone`` leaves. ``late`` must end with the job, exit 0."""
    kv = EtcdKV(etcd_server.endpoint)
    registry = RunRegistry(kv, run_id)
    try:
        lease = kv.grant_lease(30)
        registry.register(NodeInfo(node_id="gone", host="127.0.0.1", nproc=1), lease)
        admitting = Round(number=3, members=("gone", "late"), nprocs=(1, 1),
                          hosts=("127.0.0.1", "127.0.0.1"), reason="admitting late")
        kv.put(registry.key("round"), admitting.to_json())
        registry.publish_store(admitting, f"127.0.0.1:{free_port()}")  # nobody listens
        registry.mark_in_process()
        late = _node(process_tree, etcd_server, run_id, tmp_path, "late", tmp_path / "out.pt")
        wait_until(lambda: any(e.name == "worker.started" and e.node == "late"
                               for e in events(tmp_path / "events.jsonl")), 60, "late's worker")
        registry.mark_completing()
        kv.revoke_lease(lease)  # gone finished and left
        assert late.wait(timeout=60) == 0, (tmp_path / "late.log").read_text()[-3000:]
        assert registry.closed_reason() == "finished"
    finally:
        kv.close()
    exited = [e for e in events(tmp_path / "events.jsonl")
              if e.name == "agent.exited" and e.node == "late"]
    assert [e.metadata["exitcode"] for e in exited] == [0], exited


# A node back from a fence (or a replaced worker) imports torch again: seconds, more on a
# busy box. The survivors must still be training when it is ready, so these runs are longer
# (at the slow pace only until it is back).
LONG_STEPS = 500


def _assert_same_training(tmp: Path, log: list[Event], survivors: tuple[str, ...]) -> None:
    """Final parameters of the uninterrupted run; every survivor did every step once."""
    got, want = torch.load(tmp / "params.pt"), _reference_params(LONG_STEPS)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    for survivor in survivors:  # by node: ranks follow registration order
        steps = sorted(e.step for e in log if e.name == "step.completed" and e.node == survivor
                       and e.step is not None)
        assert steps == list(range(1, LONG_STEPS + 1)), f"{survivor} lost or repeated a step"
    restarted = [e for e in log if e.name == "worker.restarted" and e.node in set(survivors)]
    assert restarted == [], "survivors' workers were restarted"


def _came_back_through_standby(log: list[Event], node: str,
                               since: Callable[[Event], bool]) -> None:
    """``node``'s replacement workers started in standby, after ``since``, and the survivors
    trained without its ranks in the rounds before the one that took it back (a round
    that waited for its workers would have held their ranks).

    Told by round numbers, not by where the events fall in the log: the node asks for its
    ranks back once rank 0 has published a step of that round, and another survivor's
    event for the step may be written after the round it led to (a clean-clone run failed
    the log-order check while rank 0 still published before writing its own event).
    """
    after = next(i for i, e in enumerate(log) if since(e))
    started = [i for i, e in enumerate(log) if i > after and e.node == node
               and e.name == "worker.restarted"]
    assert [log[i].metadata.get("standby") for i in started] == [True], log[after:]
    back = next(e for e in log[started[0]:] if e.name == "round.formed"
                and e.source == "agent" and node in e.metadata.get("members", ())
                and e.metadata.get("world_size") == 3)
    assert back.round is not None
    trained = [e for e in log[after:] if e.name == "step.completed" and e.node != node
               and (e.round or 0) < back.round and e.metadata.get("world_size") == 2]
    assert trained, f"the survivors waited for {node}'s workers to start"


def test_a_node_back_from_a_fence_is_taken_back_through_the_standby_start(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    out = tmp_path / "params.pt"
    nodes = {n: _node(process_tree, etcd_server, run_id, tmp_path, n, out, nnodes="2:3",
                      steps=LONG_STEPS) for n in "abc"}
    wait_until(lambda: _step(tmp_path) >= 20, 180, "step 20")
    fault_round = max(e.round or 0 for e in events(tmp_path / "events.jsonl"))
    process_tree.signal_tree(nodes["c"].pid, signal.SIGSTOP)  # c hangs past its lease
    try:
        wait_until(lambda: [e for e in events(tmp_path / "events.jsonl")
                            if e.name == "step.completed" and (e.round or 0) > fault_round][4:],
                   60, "the others training without c")
    finally:
        process_tree.signal_tree(nodes["c"].pid, signal.SIGCONT)
    release_pace_when_training(tmp_path / "events.jsonl", tmp_path / RELEASED, "c",
                               since=lambda e: e.name == "agent.fenced" and e.node == "c")
    for name in "abc":
        assert nodes[name].wait(timeout=240) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    log = events(tmp_path / "events.jsonl")
    _assert_same_training(tmp_path, log, ("a", "b"))
    sizes = [e.metadata["world_size"] for e in log if e.name == "step.completed"]
    assert sizes[-1] == 3 and 2 in sizes, "c was not cut off, or not taken back"
    _came_back_through_standby(log, "c", lambda e: e.name == "agent.fenced" and e.node == "c")


def test_a_worker_lost_at_the_minimum_node_count_is_replaced_while_the_others_train(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    out = tmp_path / "params.pt"
    nodes = {n: _node(process_tree, etcd_server, run_id, tmp_path, n, out, nnodes="3:3",
                      steps=LONG_STEPS) for n in "abc"}
    wait_until(lambda: _step(tmp_path) >= 20, 180, "step 20")
    workers = [p for p in process_tree.tree(nodes["c"].pid) if p.pid != nodes["c"].pid]
    assert workers, "c has no worker"
    process_tree.signal_tree(workers[0].pid, signal.SIGKILL)
    release_pace_when_training(tmp_path / "events.jsonl", tmp_path / RELEASED, "c",
                               since=lambda e: e.name == "worker.failed" and e.node == "c")
    for name in "abc":
        assert nodes[name].wait(timeout=240) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    log = events(tmp_path / "events.jsonl")
    _assert_same_training(tmp_path, log, ("a", "b"))
    # c stayed a member without ranks (the job is at its minimum), then got them back.
    rounds = [e.metadata for e in log if e.name == "round.formed" and e.source == "agent"]
    assert [r["world_size"] for r in rounds if r["members"] and "c" in r["members"]][-1] == 3
    assert any(r["world_size"] == 2 and sorted(r["members"]) == ["a", "b", "c"] for r in rounds)
    sizes = [e.metadata["world_size"] for e in log if e.name == "step.completed"]
    assert sizes[-1] == 3 and 2 in sizes, "the others did not train on without c's worker"
    _came_back_through_standby(log, "c", lambda e: e.name == "worker.failed" and e.node == "c")
