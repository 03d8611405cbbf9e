"""A runtime-parallel job through a node SIGKILL: re-planned, restored by name, 0 steps lost.

Two agents run ``scripts/examples/described_train.py`` (tiny, float64), whose model must be cut
at least two ways. Node ``a`` with three workers and node ``b`` with one start together
(a long last call, so both make the first round) and train ``dp2 x pp2``: ``a`` holds stage
0 twice and stage 1 once, ``b`` the other replica of stage 1; or, with tensor parallelism
allowed, ``dp2 x tp2``: ``a`` holds both shards of one replica and one of the other. ``b``
is SIGKILLed mid-run. ``a``'s workers hold every part at the last step, so they re-plan to
``pp3`` and move the state by parameter name to the new cut (tensor shards to pipeline
stages in the second case): no checkpoint (none is configured), no step redone or skipped,
and final parameters equal to those of an uninterrupted one-process run over the same
batches.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastic_rt.events import Event
from elastic_rt.harness import REPO, child_env, wait_until
from tests.fixtures.described_reference import TINY_FLAGS, assert_outputs_equal_reference
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, exit_code, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "described_train.py")
STEPS, GLOBAL_BATCH, SAMPLES = 40, 12, 240


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str, nproc: int,
          tp_options: str):
    # a long last call: both nodes make the first round (a's workers alone would be pp3)
    args = launch_args(etcd_server.endpoint, run_id, "1:2", tmp / "events.jsonl", node_id=name,
                       nproc=nproc, extra=("--last-call", "5"))
    script = [SCRIPT, *TINY_FLAGS, "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH),
              "--samples", str(SAMPLES), "--tp-options", *tp_options.split(), "--float64",
              "--step-time", "0.1", "--out", str(tmp / "out")]
    return tree.elastic_rt(*args, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _completed(tmp: Path) -> list[Event]:
    return [e for e in events(tmp / "events.jsonl") if e.name == "step.completed" and e.rank == 0]


def _steps_in(tmp: Path, layout_world: int) -> list[int]:
    return [e.step or 0 for e in _completed(tmp) if e.metadata["world_size"] == layout_world]


@pytest.mark.parametrize("tp_options, grown", [("1", "dp2xpp2xtp1"), ("1 2", "dp2xpp1xtp2")])
def test_a_node_lost_is_replanned_to_pp3_from_the_survivors_with_no_step_lost(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path, tp_options: str,
    grown: str,
) -> None:
    nodes = {name: _node(process_tree, etcd_server, run_id, tmp_path, name, nproc, tp_options)
             for name, nproc in (("a", 3), ("b", 1))}
    wait_until(lambda: len(_steps_in(tmp_path, 4)) >= 3, 120, f"three steps under {grown}")
    os.killpg(nodes["b"].pid, signal.SIGKILL)
    assert exit_code(nodes["a"], 180, tmp_path / "a.log", tmp_path / "events.jsonl") == 0

    assert_outputs_equal_reference(tmp_path / "out", steps=STEPS, global_batch=GLOBAL_BATCH,
                                   samples=SAMPLES)

    log = events(tmp_path / "events.jsonl")
    layouts = [e.metadata["layout"] for e in log if e.name == "groups.reformed" and e.rank == 0]
    assert layouts[0] == grown, layouts
    assert layouts[-1] == "dp1xpp3xtp1", layouts
    restores = [e for e in log if e.name == "state.restored"]
    assert {e.metadata["source"] for e in restores} == {"init", "survivors"}, restores
    assert restores[-1].node == "a" and restores[-1].metadata["source"] == "survivors"
    steps = [e.step for e in _completed(tmp_path)]
    assert steps == list(range(1, STEPS + 1)), steps  # every step once
    assert _steps_in(tmp_path, 3)[-1] == STEPS
    resumed = [e for e in log if e.name == "step.resumed" and e.rank == 0]
    restored = [e for e in log if e.name == "state.restored" and e.rank == 0]
    print(f"failure -> next step: {resumed[-1].metadata['downtime_ms']} ms; restore "
          f"{restored[-1].metadata['duration_ms']} ms ({restored[-1].metadata['source']})")
