"""Node loss and growth under HSDP and FSDP, in a live job: re-shard in place, no storage read.

Agents with two gloo workers each run ``scripts/examples/fsdp_train.py`` with ``--max-shard 2``:
two nodes train as ``hsdp2x2`` (each node holds one sharded copy of parameters, gradients and
Adam state), while node ``c`` waits to join with its workers started. Node ``b`` is SIGKILLed;
``a``'s workers re-plan (``fsdp2`` alone, or ``hsdp2x2`` with ``c`` at once, depending on when
the agents admit ``c``) and take every piece from their own replica, since no checkpoint is
configured; ``c`` takes its pieces from ``a``'s ranks. No step may be lost or done twice, and
the final parameters must equal those of an uninterrupted single-process run.

Under FSDP (``fsdp4``: no replica) the same kill takes half of every parameter's rows. ``a``'s
ranks hold copies of ``b``'s pieces in host memory (refreshed every step, beside training), so
they restore from those, with no checkpoint configured, redoing at most one step; ``c`` starts
only then, and grows the job back to ``fsdp4`` in a round of its own, taking its pieces from
``a``'s live ones in place.

With three one-worker nodes as ``fsdp3`` (copies on), ``b`` and ``c`` are SIGKILLed at once: a
node and the holder of its copies are both lost, so ``a`` cannot cover every piece from
memory. It loads the newest committed checkpoint resharded to its own single rank and redoes
the steps after it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from elastic_rt.events import Event
from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from scripts.examples import fsdp_train as ft
from tests.fixtures.fsdp_reference import reference_params
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args, release_pace_when_training

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "fsdp_train.py")
GLOBAL_BATCH, WIDTH, HIDDEN = 12, 32, 64
RELEASED = "pace-released"


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str, extra: list[str],
          case: Case):
    args = launch_args(etcd_server.endpoint, run_id, f"1:{len(case.nodes)}",
                       tmp / "events.jsonl", node_id=name, nproc=case.nproc)
    script = [SCRIPT, "--steps", str(case.steps), "--step-time", "0.1",
              "--step-time-until", str(tmp / RELEASED), *extra,
              "--global-batch", str(GLOBAL_BATCH), "--out", str(tmp / "out")]
    return tree.elastic_rt(*args, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _completed(tmp: Path) -> list[Event]:
    return [e for e in events(tmp / "events.jsonl") if e.name == "step.completed" and e.rank == 0]


def _formed(tmp: Path, members: list[str]) -> bool:
    return any(e.name == "round.formed" and sorted(e.metadata.get("members", ())) == members
               for e in events(tmp / "events.jsonl"))


def _trained(tmp: Path, world_size: int, after: int = 0) -> bool:
    return any(step > after for step in _steps_in(tmp, world_size))


def _restored(tmp: Path, node: str, source: str) -> bool:
    return any(e.name == "state.restored" and e.node == node
               and e.metadata["source"].startswith(source) for e in events(tmp / "events.jsonl"))


def _steps_in(tmp: Path, world_size: int) -> list[int]:
    return [e.step or 0 for e in _completed(tmp) if e.metadata["world_size"] == world_size]


@dataclass(frozen=True)
class Case:
    layouts: tuple[str, str]  # a's layout while all nodes train, and its last one
    flags: list[str]  # the script's
    restored_from: str  # where a's ranks restore from after the kill
    nodes: str = "ab"  # they train together; all but a are SIGKILLed at once
    joins: str = ""  # when c starts: "before the kill" (admitted with the recovery round or
    # the next one, as the agents decide) or "after the recovery" (a growth round of its own)
    nproc: int = 2
    steps: int = 200  # at 0.1 s until c is admitted: room for c's workers to start and join


CKPT = ["--checkpoint", "CKPT"]
CASES = {
    "hsdp": Case(("hsdp2x2", "hsdp2x2"), ["--max-shard", "2"], "replicas",
                 joins="before the kill", steps=100),  # c started (registered) before it
    "fsdp": Case(("fsdp4", "fsdp4"), ["--max-shard", "64"], "peer copies",
                 joins="after the recovery"),
    "fsdp-copy-holder-lost": Case(("fsdp3", "dp1xpp1xtp1"),
                                  ["--max-shard", "64", *CKPT, "--every", "5"], "checkpoint",
                                  nodes="abc", nproc=1, steps=60),  # nobody joins
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_node_loss_and_growth_reshard_in_place_and_end_like_a_clean_run(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    layout, final_layout = case.layouts
    extra = [str(tmp_path / "ckpt") if arg == "CKPT" else arg for arg in case.flags]
    nodes = {node: _node(process_tree, etcd_server, run_id, tmp_path, node, extra, case)
             for node in case.nodes}
    wait_until(lambda: _formed(tmp_path, sorted(case.nodes)), 60, "the round of all nodes")
    if case.joins == "before the kill":
        # c's workers start (slow on a busy box) while a and b train; it joins after the kill.
        nodes["c"] = _node(process_tree, etcd_server, run_id, tmp_path, "c", extra, case)
        kv = EtcdKV(etcd_server.endpoint)
        try:  # c registers once it is ready to be admitted
            wait_until(lambda: "c" in RunRegistry(kv, run_id).nodes(), 180, "c ready")
        finally:
            kv.close()
    world = len(case.nodes) * case.nproc
    wait_until(lambda: _trained(tmp_path, world, after=5), 180, "training past step 5")
    if case.restored_from == "checkpoint":
        wait_until(lambda: any(e.name == "checkpoint.committed"
                               for e in events(tmp_path / "events.jsonl")), 120, "a checkpoint")
    for node in case.nodes[1:]:
        os.killpg(nodes[node].pid, signal.SIGKILL)
    if case.joins == "after the recovery":
        # a restores alone first; c then grows the job in a round of its own and takes its
        # pieces from a's live ones.
        wait_until(lambda: _restored(tmp_path, "a", case.restored_from), 120, "a's recovery")
        nodes["c"] = _node(process_tree, etcd_server, run_id, tmp_path, "c", extra, case)
    survivors = "ac" if case.joins else "a"
    if case.joins:
        release_pace_when_training(tmp_path / "events.jsonl", tmp_path / RELEASED, "c")
    for node in survivors:
        assert nodes[node].wait(timeout=180) == 0, (tmp_path / f"{node}.log").read_text()[-3000:]

    got = ft.join_params(str(tmp_path / "out"))
    want = reference_params(steps=case.steps, global_batch=GLOBAL_BATCH, width=WIDTH,
                            hidden=HIDDEN)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)

    log = events(tmp_path / "events.jsonl")
    layouts = [e.metadata["layout"] for e in log if e.name == "groups.reformed" and e.node == "a"]
    assert layout in layouts and layouts[-1] == final_layout, layouts
    assert len(layouts) >= 2 * case.nproc, layouts
    restored = [e for e in log if e.name == "state.restored"]
    by_node = {node: {e.metadata["source"].split(" step-")[0] for e in restored if e.node == node}
               for node in survivors}
    # The pieces were all in memory somewhere (a round that only adds a node takes them from
    # the members' live pieces: "replicas"), or the checkpoint when no memory had them all.
    assert case.restored_from in by_node["a"], by_node
    assert by_node["a"] <= {"init", case.restored_from, "replicas"}, by_node
    if case.joins == "before the kill":
        assert by_node["c"] and by_node["c"] <= {"replicas", case.restored_from}, by_node
    elif case.joins:
        assert by_node["c"] == {"replicas"}, by_node  # a growth: from a's live pieces
        alone = {"fsdp4": "fsdp2"}[layout]
        grown = [i for i, held in enumerate(layouts) if held == final_layout]
        assert alone in layouts and layouts.index(alone) < grown[-1], \
            f"no growth from {alone} back to {final_layout}: {layouts}"
    assert not [e for e in log if e.name == "worker.restarted"], "recovery was not in-process"
    # Each of a's workers did every step, none skipped; from peer copies, at most one step
    # again (the copy of a step is taken at the start of the next, and counts once it has
    # arrived); from the checkpoint, at most the steps since it.
    steps = sorted(e.step or 0 for e in log if e.name == "step.completed" and e.node == "a")
    redone = (len(steps) - case.nproc * case.steps) // case.nproc
    assert sorted(set(steps)) == list(range(1, case.steps + 1)), "a step was skipped"
    most = {"replicas": 0, "peer copies": 1, "checkpoint": 5}[case.restored_from]
    assert 0 <= redone <= most, redone
