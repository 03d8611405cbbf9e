"""The loop features real training needs, end to end under ``elastic-rt launch``.

- fp16 autocast with its GradScaler, clipping, an LR schedule and DataLoader worker
  processes through a node kill end with the parameters of an uninterrupted one-worker
  run (micro-batches of one sample keep every sample's low-precision backward the same
  whatever the world; see ``worker/grad_sync.py``);
- the schedule and the scaler come back from a checkpoint when the job is relaunched;
- a bug in the user's step ends the job at once on every node, once, with its traceback
  and a one-line root cause — not three job-wide retries.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import events, launch_args

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
FEATURES = ("--amp", "fp16", "--micro-batch", "1", "--clip", "0.5", "--schedule",
            "--num-workers", "1")


def _node(tree: ProcessTree, etcd_server, run_id: str, tmp: Path, name: str, *script: str,
          nnodes: str = "2:3"):
    args = launch_args(etcd_server.endpoint, run_id, nnodes, tmp / "events.jsonl", node_id=name)
    return tree.elastic_rt(*args, SCRIPT, *script, env=child_env(), log=str(tmp / f"{name}.log"))


def _last_step(tmp: Path) -> int:
    return max((e.step or 0 for e in events(tmp / "events.jsonl") if e.name == "step.completed"),
               default=0)


def _assert_same_parameters(got_path: Path, want_path: Path) -> None:
    got, want = torch.load(got_path), torch.load(want_path)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)


def _finished(node, log: Path) -> None:
    assert node.wait(timeout=180) == 0, log.read_text()[-3000:]


def test_amp_clipping_schedule_and_loader_workers_match_an_uninterrupted_run_through_a_kill(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    steps = ("--steps", "30", "--step-time", "0.05", *FEATURES)
    ref = tmp_path / "reference"
    ref.mkdir()
    reference = _node(process_tree, etcd_server, run_id + "-ref", ref, "solo", *steps,
                      "--out", str(ref / "params.pt"), nnodes="1")
    out = tmp_path / "params.pt"
    nodes = {n: _node(process_tree, etcd_server, run_id, tmp_path, n, *steps, "--out", str(out))
             for n in "abc"}
    wait_until(lambda: _last_step(tmp_path) >= 10, 180, "step 10")
    os.killpg(nodes["c"].pid, signal.SIGKILL)
    for name in "ab":
        _finished(nodes[name], tmp_path / f"{name}.log")
    _finished(reference, ref / "solo.log")

    _assert_same_parameters(out, ref / "params.pt")
    log = events(tmp_path / "events.jsonl")
    assert {e.metadata["world_size"] for e in log if e.name == "step.completed"} == {3, 2}
    for survivor in "ab":  # (rank 0 may have been the node killed)
        done = sorted(e.step for e in log if e.name == "step.completed" and e.node == survivor
                      and e.step is not None)
        assert done == list(range(1, 31)), f"{survivor} skipped a step or did one twice"
    assert not [e for e in log if e.name == "worker.restarted"]


def test_schedule_and_scaler_come_back_from_a_checkpoint_when_the_job_is_relaunched(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    ckpt = f"file://{tmp_path / 'ckpt'}"
    first, second, ref = (tmp_path / d for d in ("first", "second", "reference"))
    for d in (first, second, ref):
        d.mkdir()
    common = (*FEATURES, "--checkpoint", ckpt, "--every", "10")
    reference = _node(process_tree, etcd_server, run_id + "-ref", ref, "solo", "--steps", "30",
                      *FEATURES, "--out", str(ref / "params.pt"), nnodes="1")
    part = _node(process_tree, etcd_server, run_id, first, "a", "--steps", "20", *common,
                 nnodes="1")
    _finished(part, first / "a.log")
    rest = _node(process_tree, etcd_server, run_id + "-again", second, "a", "--steps", "30",
                 *common, "--out", str(second / "params.pt"), "--hook-count",
                 str(second / "hooks"), nnodes="1")
    _finished(rest, second / "a.log")
    _finished(reference, ref / "solo.log")

    _assert_same_parameters(second / "params.pt", ref / "params.pt")
    resumed = [e.step for e in events(second / "events.jsonl") if e.name == "step.completed"]
    assert resumed == list(range(21, 31)), resumed  # restored at step 20, not from scratch
    # the restore built the optimizer's state without a user-visible optimizer.step()
    assert (second / "hooks").read_text() == "10"


def test_a_user_exception_ends_the_job_once_with_its_traceback_and_root_cause(
    process_tree: ProcessTree, etcd_server, run_id: str, tmp_path: Path
) -> None:
    nodes = {n: _node(process_tree, etcd_server, run_id, tmp_path, n, "--steps", "40",
                      "--fail-at-step", "5", nnodes="2")
             for n in "ab"}
    for name, node in nodes.items():
        assert node.wait(timeout=120) == 1, (tmp_path / f"{name}.log").read_text()[-3000:]

    kv = EtcdKV(etcd_server.endpoint)
    try:
        reason = RunRegistry(kv, run_id).closed_reason()
    finally:
        kv.close()
    assert reason is not None and reason.startswith("failed: rank 0 failed at step 5: "
                                                    "RuntimeError: mat1 and mat2 shapes"), reason
    log = events(tmp_path / "events.jsonl")
    assert [e.step for e in log if e.name == "step.failed"] == [5]
    assert not [e for e in log if e.name in ("worker.restarted", "step.resumed")]
    assert max((e.metadata["attempt"] for e in log if e.name == "step.retried"), default=0) <= 1
    output = "".join((tmp_path / f"{n}.log").read_text() for n in "ab")
    assert output.count("Traceback (most recent call last)") >= 1
    assert output.count("in train_step") == 1, "the user's traceback is printed once"
    # ... in the root-cause table, by the agent of the rank that raised
    assert output.count("Root Cause (first observed failure)") == 1
    assert "rank      : 0 (round 0)" in output and "step      : 5" in output
    assert "rank 0 failed at step 5: RuntimeError: mat1 and mat2 shapes" in output
