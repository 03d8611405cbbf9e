"""Model-parallel node loss in a live job: roll back to the checkpoint, re-plan, reshard, go on.

Two agents with two gloo workers each run ``scripts/examples/pipeline_train.py``, whose model
must be cut into pipeline stages: ``dp2 x pp2``, one node holding each stage. After a
checkpoint is committed, one node is SIGKILLed, taking a stage with no replica left. The two
survivors must roll back to the newest committed checkpoint, re-plan to ``pp2``, load it
resharded, redo the lost steps and finish with the parameters of an uninterrupted
single-process run of the same batches.
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
from elastic_rt.sampler import ElasticSampler
from scripts.examples import parallel_models as pm
from scripts.examples import pipeline_train as pt
from tests.fixtures.processes import ProcessTree, wait_until
from tests.integration.launch_helpers import REPO, agent_env, events, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "pipeline_train.py")
STEPS, EVERY, GLOBAL_BATCH, SAMPLES = 40, 10, 12, 240


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str):
    # A longer last call, so that the first round usually has both nodes (a late one would
    # join at a step boundary and get its stage from the replicas, which is fine too).
    args = launch_args(etcd_server.endpoint, run_id, "1:2", tmp / "events.jsonl", node_id=name,
                       nproc=2, extra=("--last-call", "2"))
    script = [SCRIPT, "--steps", str(STEPS), "--every", str(EVERY), "--step-time", "0.1",
              "--global-batch", str(GLOBAL_BATCH), "--samples", str(SAMPLES),
              "--checkpoint", f"file://{tmp / 'ckpt'}", "--out", str(tmp / "out")]
    return tree.elastic_rt(*args, *script, env=agent_env(), log=str(tmp / f"{name}.log"))


def _completed(log: list[Event]) -> list[Event]:
    return [e for e in log if e.name == "step.completed" and e.rank == 0]


def _ready_to_kill(tmp: Path) -> bool:
    """A checkpoint is committed and the full world has trained a couple of steps past it."""
    log = events(tmp / "events.jsonl")
    committed = [e.step for e in log if e.name == "checkpoint.committed"]
    done = _completed(log)
    return bool(committed and done and done[-1].metadata["world_size"] == 4
                and done[-1].step >= max(committed) + 2)


def _reference_params() -> dict[str, torch.Tensor]:
    """The uninterrupted run: one process, the same global batches in the same order."""
    data = pt.Pairs(SAMPLES)
    sampler = ElasticSampler(len(data), global_batch_size=GLOBAL_BATCH, seed=0)
    trainer = pm.ReferenceTrainer()
    for _ in range(STEPS):
        trainer.step(default_collate([data[i] for i in sampler.global_batch()]))
        sampler.advance()
    return trainer.full_params()


def _stage_of(node: str, log: list[Event]) -> set[str]:
    return {e.metadata["layout"] for e in log if e.name == "groups.reformed" and e.node == node}


def test_losing_a_pipeline_stage_rolls_back_to_the_checkpoint_and_ends_like_a_clean_run(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    nodes = {n: _node(process_tree, etcd_server, run_id, tmp_path, n) for n in "ab"}
    wait_until(lambda: _ready_to_kill(tmp_path), 180, "a committed checkpoint under dp2xpp2")
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
    newest = max(e.step for e in before if e.name == "checkpoint.committed")
    last_trained = max(e.step for e in _completed(before))
    restored = [e for e in log if e.name == "checkpoint.restored" and e.source == "worker"]
    assert restored and {e.step for e in restored} == {newest}, restored
    sources = {e.metadata["source"] for e in log if e.name == "state.restored" and e.node == "a"}
    assert any(s.startswith("checkpoint step-") for s in sources), sources
    assert {"dp2xpp2xtp1", "dp1xpp2xtp1"} <= _stage_of("a", log)
    # The steps after the checkpoint are done again, and none is skipped.
    steps = [e.step for e in _completed(log)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    assert steps.count(newest + 1) == 2 and last_trained - newest <= 2 * EVERY
