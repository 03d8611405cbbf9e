"""A runtime-parallel job through a node SIGKILL (and a growth back): re-planned, restored
by name, equal to one process.

Two agents run ``scripts/examples/described_train.py`` (the tiny Llama-style decoder,
float64), whose model must be cut at least two ways. Nodes ``a`` and ``b`` start together
(a long last call, so both make the first round) and train

- ``fsdp2 x tp2`` (2 + 2 workers, tensor parallelism required) with the example's
  sequence-parallel plans: each tensor shard sharded again over the two data-parallel ranks,
  ``b`` holding the second FSDP piece of both, the activations cut along the sequence;
- or ``pp2 x fsdp2`` on nodes of 3 and 1 workers, with a checkpoint every few steps.

``b`` is SIGKILLed mid-run. In the first case ``b``'s pieces had no other holder: they come
from the peer copies ``a``'s ranks keep of them (at most one step done again), into ``tp2``
with no checkpoint configured; then a new node ``b2`` joins and the job grows back to
``fsdp2 x tp2``, its pieces moved by name from the members. In the second, ``b``'s one rank
holds the copies of ``a``'s three and ``a``'s first rank holds ``b``'s (``copy_placement``):
``b``'s piece comes back from that copy, not from the checkpoint the job also writes, into
``pp3``. Both end with final parameters equal to those of an uninterrupted one-process run
over the same batches. A loss whose survivors hold every part (``dp2 x pp2``, ``dp2 x tp2``:
the state moves by name, no step redone) and its growth back are tried in one test pool,
without agents: ``test_runtime_parallel_reshard.py``.
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
from tests.integration.launch_helpers import (events, exit_code, launch_args,
                                              release_pace_when_training)

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "described_train.py")
GLOBAL_BATCH, SAMPLES, EVERY = 12, 240, 4
PP3 = "dp1xpp3xtp1"


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str, nproc: int,
          flags: list[str]):
    # a long last call: both nodes make the first round (a's workers alone would be pp3)
    args = launch_args(etcd_server.endpoint, run_id, "1:2", tmp / "events.jsonl", node_id=name,
                       nproc=nproc, extra=("--last-call", "5"))
    script = [SCRIPT, *TINY_FLAGS, "--global-batch", str(GLOBAL_BATCH), "--samples",
              str(SAMPLES), *flags, "--float64", "--out", str(tmp / "out")]
    return tree.elastic_rt(*args, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _completed(tmp: Path) -> list[Event]:
    return [e for e in events(tmp / "events.jsonl") if e.name == "step.completed" and e.rank == 0]


def _steps_in(tmp: Path, layout_world: int) -> list[int]:
    return [e.step or 0 for e in _completed(tmp) if e.metadata["world_size"] == layout_world]


def _layouts(tmp: Path) -> list[str]:
    return [e.metadata["layout"] for e in events(tmp / "events.jsonl")
            if e.name == "groups.reformed" and e.rank == 0]


@pytest.mark.parametrize("flags, workers, first, after, grow", [
    pytest.param("--tp-options 2 --max-shard 2 --sequence-parallel", (2, 2), "fsdp2xtp2",
                 "dp1xpp1xtp2", True, id="fsdp2xtp2-sequence-parallel-copies-then-growth"),
    pytest.param(f"--tp-options 1 --max-pp 3 --max-shard 2 --min-cut 3 --every {EVERY}", (3, 1),
                 "pp2xfsdp2", PP3, False, id="pp2xfsdp2-unequal-nodes-copies-not-checkpoint"),
])
def test_a_node_lost_is_replanned_and_ends_equal_to_one_process(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path, flags: str,
    workers: tuple[int, int], first: str, after: str, grow: bool,
) -> None:
    # Growing takes b2 ~7 s on this machine (start, build ahead, last call): longer, slower
    # steps give it room (~25 s) before the job ends, slow only until it is admitted.
    steps, step_time = (80, 0.3) if grow else (40, 0.1)
    checkpoints = "--every" in flags  # written, yet the copies are newer
    released = tmp_path / "pace-released"
    script = [*flags.split(), "--steps", str(steps), "--step-time", str(step_time),
              "--step-time-until", str(released),
              *(["--checkpoint", str(tmp_path / "ckpt")] if checkpoints else [])]
    nodes = {name: _node(process_tree, etcd_server, run_id, tmp_path, name, nproc, script)
             for name, nproc in zip("ab", workers)}
    wait_until(lambda: len(_steps_in(tmp_path, 4)) >= 3, 120, f"three steps under {first}")
    if checkpoints:
        wait_until(lambda: any(e.name == "checkpoint.committed"
                               for e in events(tmp_path / "events.jsonl")), 120, "a checkpoint")
    os.killpg(nodes["b"].pid, signal.SIGKILL)
    want = [first, after]
    if grow:
        world = 4 - workers[1]
        wait_until(lambda: len(_steps_in(tmp_path, world)) >= 2, 120, f"two steps under {after}")
        # a new node under a new id: the job grows back to four ranks
        nodes["b2"] = _node(process_tree, etcd_server, run_id, tmp_path, "b2", workers[1],
                            script)
        release_pace_when_training(tmp_path / "events.jsonl", released, "b2")
        want.append(first)
    for name in nodes.keys() - {"b"}:
        assert exit_code(nodes[name], 180, tmp_path / f"{name}.log",
                         tmp_path / "events.jsonl") == 0

    assert_outputs_equal_reference(tmp_path / "out", steps=steps, global_batch=GLOBAL_BATCH,
                                   samples=SAMPLES)

    log = events(tmp_path / "events.jsonl")
    assert _layouts(tmp_path) == want
    restored = [e for e in log if e.name == "state.restored" and e.rank == 0]
    sources = [e.metadata["source"] for e in restored]
    assert sources == ["init", "peer copies"] + ["survivors"] * grow, restored
    back_at = restored[1].step or 0  # the step the state came back at
    ran = max(e.step or 0 for e in _completed(tmp_path)
              if e.timestamp_ms < restored[1].timestamp_ms)
    assert ran - 1 <= back_at <= ran, (back_at, ran)  # from b's copies: at most one redone
    done = [e.step for e in _completed(tmp_path)]  # each step once, but those redone
    assert done == [*range(1, ran + 1), *range(back_at + 1, steps + 1)], done
    assert _steps_in(tmp_path, 4 if grow else 3)[-1] == steps
    assert checkpoints or not any(e.name == "checkpoint.committed" for e in log)
    resumed = [e for e in log if e.name == "step.resumed" and e.rank == 0]
    print(f"{first}: failure -> next step {resumed[0].metadata['downtime_ms']} ms; restore "
          f"{restored[1].metadata['duration_ms']} ms (peer copies, {ran - back_at} steps redone)"
          + (f"; {after} trained steps {_steps_in(tmp_path, 4 - workers[1])[0]}-"
             f"{_steps_in(tmp_path, 4 - workers[1])[-1]}" if grow else ""))
