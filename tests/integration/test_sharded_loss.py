"""Node loss and growth under HSDP and FSDP, in a live job: re-shard in place, no storage read.

Agents with two gloo workers each run ``scripts/examples/fsdp_train.py`` with ``--max-shard 2``:
two nodes train as ``hsdp2x2`` (each node holds one sharded copy of parameters, gradients and
Adam state), while node ``c`` waits to join with its workers started. Node ``b`` is SIGKILLed;
``a``'s workers re-plan (``fsdp2`` alone, or ``hsdp2x2`` with ``c`` at once, depending on when
the agents admit ``c``) and take every piece from their own replica, since no checkpoint is
configured; ``c`` takes its pieces from ``a``'s ranks. No step may be lost or done twice, and
the final parameters must equal those of an uninterrupted single-process run.

Under FSDP (``fsdp4``: no replica) the same kill takes half of every parameter's rows, and no
node joins: ``a``'s ranks re-shard to ``fsdp2`` in place. They hold copies of ``b``'s pieces in
host memory (refreshed every step), so they restore from those, not from the committed
checkpoint, redoing at most one step. With the copies off (as when a node and the holder of
its copies are lost together) they load the newest committed checkpoint resharded to
``fsdp2`` and redo the steps after it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from elastic_rt.events import Event
from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.sampler import ElasticSampler
from scripts.examples import fsdp_train as ft
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "fsdp_train.py")
STEPS, GLOBAL_BATCH, WIDTH, HIDDEN = 200, 12, 32, 64


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str, extra: list[str]):
    args = launch_args(etcd_server.endpoint, run_id, "1:2", tmp / "events.jsonl", node_id=name,
                       nproc=2)
    script = [SCRIPT, "--steps", str(STEPS), "--step-time", "0.1", *extra,
              "--global-batch", str(GLOBAL_BATCH), "--out", str(tmp / "out")]
    return tree.elastic_rt(*args, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _completed(tmp: Path) -> list[Event]:
    return [e for e in events(tmp / "events.jsonl") if e.name == "step.completed" and e.rank == 0]


def _formed(tmp: Path, members: list[str]) -> bool:
    return any(e.name == "round.formed" and sorted(e.metadata.get("members", ())) == members
               for e in events(tmp / "events.jsonl"))


def _trained(tmp: Path, world_size: int, after: int = 0) -> bool:
    return any(step > after for step in _steps_in(tmp, world_size))


def _steps_in(tmp: Path, world_size: int) -> list[int]:
    return [e.step or 0 for e in _completed(tmp) if e.metadata["world_size"] == world_size]


def _reference_params() -> dict[str, torch.Tensor]:
    """One process, the whole global batch per step: what every layout must end with."""
    data = ft.Regression(n=GLOBAL_BATCH * 50, width=WIDTH)
    sampler = ElasticSampler(len(data), global_batch_size=GLOBAL_BATCH, seed=0)
    model = ft.make_model(WIDTH, HIDDEN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        x, y = default_collate([data[i] for i in sampler.global_batch()])
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        sampler.advance()
    return {name: p.detach() for name, p in model.named_parameters()}


CASES = {
    # layouts before and after the kill, script flags, the source a's ranks restore from
    "hsdp": (("hsdp2x2", "hsdp2x2"), ["--max-shard", "2"], "replicas"),
    "fsdp": (("fsdp4", "fsdp2"), ["--max-shard", "64", "--checkpoint", "CKPT", "--every", "10"],
             "peer copies"),
    "fsdp-no-copies": (("fsdp4", "fsdp2"), ["--max-shard", "64", "--checkpoint", "CKPT",
                                            "--every", "5", "--peer-copy-every", "0"],
                       "checkpoint"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_node_loss_and_growth_reshard_in_place_and_end_like_a_clean_run(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path, case: str
) -> None:
    (layout, final_layout), extra, restored_from = CASES[case]
    grows = layout == final_layout  # HSDP: c joins; FSDP: a goes on alone
    extra = [str(tmp_path / "ckpt") if arg == "CKPT" else arg for arg in extra]
    nodes = {name: _node(process_tree, etcd_server, run_id, tmp_path, name, extra)
             for name in "ab"}
    wait_until(lambda: _formed(tmp_path, ["a", "b"]), 60, "the round of a and b")
    if grows:
        # c's workers start (slow on a busy box) while a and b train; it joins after the kill.
        nodes["c"] = _node(process_tree, etcd_server, run_id, tmp_path, "c", extra)
        kv = EtcdKV(etcd_server.endpoint)
        try:  # c registers once it is ready to be admitted
            wait_until(lambda: "c" in RunRegistry(kv, run_id).nodes(), 180, "c ready")
        finally:
            kv.close()
    wait_until(lambda: _trained(tmp_path, 4, after=5), 180, "training past step 5")
    if restored_from == "checkpoint":
        wait_until(lambda: any(e.name == "checkpoint.committed"
                               for e in events(tmp_path / "events.jsonl")), 120, "a checkpoint")
    os.killpg(nodes["b"].pid, signal.SIGKILL)
    for name in "ac" if grows else "a":
        assert nodes[name].wait(timeout=180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    got = ft.join_params(str(tmp_path / "out"))
    want = _reference_params()
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)

    log = events(tmp_path / "events.jsonl")
    layouts = [e.metadata["layout"] for e in log if e.name == "groups.reformed" and e.node == "a"]
    assert layouts[0] == layout and layouts[-1] == final_layout and len(layouts) >= 4, layouts
    restored = [e for e in log if e.name == "state.restored"]
    by_node = {node: {e.metadata["source"].split(" step-")[0] for e in restored if e.node == node}
               for node in "ac"}
    # The pieces were all in memory somewhere, or (copies off) the checkpoint.
    assert by_node["a"] == {"init", restored_from}, by_node
    assert by_node["c"] <= {"replicas", restored_from} and bool(by_node["c"]) == grows, by_node
    assert not [e for e in log if e.name == "worker.restarted"], "recovery was not in-process"
    # Each of a's two workers did every step, none skipped; from peer copies, at most one
    # step again (the copy is taken at the start of the next step); from the checkpoint, at
    # most the steps since it.
    steps = sorted(e.step or 0 for e in log if e.name == "step.completed" and e.node == "a")
    redone = (len(steps) - 2 * STEPS) // 2
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), "a step was skipped"
    most = {"replicas": 0, "peer copies": 1, "checkpoint": 5}[restored_from]
    assert 0 <= redone <= most, redone
