"""Model-parallel node loss in a live job: roll back to the checkpoint, re-plan, reshard, go on.

Agents with two gloo workers each run ``scripts/examples/pipeline_train.py``, whose model must
be cut into pipeline stages. Node ``a`` starts alone (``pp2``); node ``b`` joins and the job
grows to ``dp2 x pp2`` with ``b`` holding both replicas of stage 1, which it gets from ``a``'s
ranks (no checkpoint involved). After a checkpoint is committed, ``b`` is SIGKILLed, taking a
stage with no replica left. ``a``'s workers must roll back to the newest committed checkpoint,
re-plan to ``pp2``, load it resharded, redo the lost steps and finish with the parameters of
an uninterrupted single-process run of the same batches.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from elastic_rt.events import Event
from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.sampler import ElasticSampler
from elastic_rt.harness import parallel_models as pm
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "pipeline_train.py")
STEPS, EVERY, GLOBAL_BATCH, SAMPLES = 80, 10, 12, 240


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str):
    args = launch_args(etcd_server.endpoint, run_id, "1:2", tmp / "events.jsonl", node_id=name,
                       nproc=2)
    script = [SCRIPT, "--steps", str(STEPS), "--every", str(EVERY), "--step-time", "0.15",
              "--global-batch", str(GLOBAL_BATCH), "--samples", str(SAMPLES),
              "--checkpoint", f"file://{tmp / 'ckpt'}", "--out", str(tmp / "out")]
    return tree.elastic_rt(*args, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _step(event: Event) -> int:
    """The step of an event that must have one (step.completed, checkpoint.*)."""
    assert event.step is not None, event
    return event.step


def _completed(log: list[Event]) -> list[Event]:
    return [e for e in log if e.name == "step.completed" and e.rank == 0]


def _ready_to_kill(tmp: Path) -> bool:
    """The grown job committed a checkpoint, trained past it, and is not saving now.

    A kill in the middle of a save is another test's subject (the save's collectives then
    wait out their timeout); here the rollback and the resharding are.
    """
    log = events(tmp / "events.jsonl")
    done = _completed(log)
    grown = [_step(e) for e in done if e.metadata["world_size"] == 4]
    committed = [_step(e) for e in log if e.name == "checkpoint.committed"]
    if not grown or not committed or done[-1].metadata["world_size"] != 4:
        return False
    newest = max(committed)
    return newest > grown[0] and newest + 2 <= _step(done[-1]) <= newest + EVERY - 4


def _reference_params() -> dict[str, torch.Tensor]:
    """The uninterrupted run: one process, the same global batches in the same order."""
    data = pm.Pairs(SAMPLES)
    sampler = ElasticSampler(len(data), global_batch_size=GLOBAL_BATCH, seed=0)
    trainer = pm.ReferenceTrainer()
    for _ in range(STEPS):
        trainer.step(default_collate([data[i] for i in sampler.global_batch()]))
        sampler.advance()
    return trainer.full_params()


def _layouts(node: str, log: list[Event]) -> set[str]:
    return {e.metadata["layout"] for e in log if e.name == "groups.reformed" and e.node == node}


def _sources(node: str, log: list[Event]) -> set[str]:
    return {e.metadata["source"].split("-")[0] for e in log
            if e.name == "state.restored" and e.node == node}


def test_losing_a_pipeline_stage_rolls_back_to_the_checkpoint_and_ends_like_a_clean_run(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    nodes = {"a": _node(process_tree, etcd_server, run_id, tmp_path, "a")}
    wait_until(lambda: _completed(events(tmp_path / "events.jsonl")), 180, "a step on node a")
    nodes["b"] = _node(process_tree, etcd_server, run_id, tmp_path, "b")
    wait_until(lambda: _ready_to_kill(tmp_path), 180, "a checkpoint committed under dp2xpp2")
    os.killpg(nodes["b"].pid, signal.SIGKILL)
    killed_ms = time.time() * 1000
    assert nodes["a"].wait(timeout=180) == 0, (tmp_path / "a.log").read_text()[-3000:]

    got: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "out").glob("rank-*.pt")):
        got.update(torch.load(path))
    want = _reference_params()
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)

    log = events(tmp_path / "events.jsonl")
    before = [e for e in log if e.timestamp_ms <= killed_ms]
    newest = max(_step(e) for e in before if e.name == "checkpoint.committed")
    last_trained = max(_step(e) for e in _completed(before))
    restored = [e for e in log if e.name == "checkpoint.restored" and e.source == "worker"]
    assert restored and {_step(e) for e in restored} == {newest}, restored
    # Growing came from the replicas; losing stage 1 from the checkpoint.
    assert _sources("a", log) == {"init", "replicas", "checkpoint step"}, _sources("a", log)
    assert _sources("b", log) == {"replicas"}, _sources("b", log)
    assert _layouts("a", log) == {"dp1xpp2xtp1", "dp2xpp2xtp1"}, _layouts("a", log)
    assert not [e for e in log if e.name == "worker.restarted"], "recovery was not in-process"
    # No step was lost growing; the steps after the checkpoint were done again, none skipped.
    steps = [_step(e) for e in _completed(log)]
    assert [_step(e) for e in _completed(before)] == list(range(1, last_trained + 1))
    assert steps == list(range(1, last_trained + 1)) + list(range(newest + 1, STEPS + 1))
