"""Async checkpoint staging: CPU copies the next step cannot change, pinned only for GPU tensors.

The CUDA path (pinned buffers, non-blocking copies, an event before the write) runs in
``scripts/device_check.py`` on a machine with a GPU; here the CPU path and the choice.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from elastic_rt.checkpoint.async_save import Stager, should_pin
from elastic_rt.checkpoint.checkpointer import Checkpointer
from elastic_rt.worker.loop import _ElasticLoop
from elastic_rt.worker.run_options import RunOptions
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.replicated import ReplicatedTrainer
from elastic_rt.worker.trainers.runtime_step import StepOptions


def test_staged_copies_keep_the_values_of_the_save_step() -> None:
    weights = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    staged = Stager().stage({"w": weights})
    staged.wait_copied()
    weights.add_(100)  # the next training step
    assert staged.tensors["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert staged.events == ()  # nothing in flight from the CPU


def test_buffers_are_reused_from_save_to_save_and_not_pinned_for_cpu_tensors() -> None:
    stager = Stager()
    first = stager.stage({"w": torch.zeros(4), "b": torch.zeros(2)}).tensors
    second = stager.stage({"w": torch.ones(4)}).tensors
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert not second["w"].is_pinned()
    assert stager.nbytes == 4 * 4  # the dropped key's buffer is gone


def test_only_gpu_tensors_get_page_locked_staging() -> None:
    assert not should_pin(torch.zeros(1))
    assert not should_pin(torch.zeros(1, device="meta"))


def test_a_dtensor_is_staged_as_a_dtensor_over_the_staging_buffer() -> None:
    # One process, a one-rank CPU mesh; the point is that the staged DTensor's local
    # tensor is the host buffer itself (from_local would move it to a CUDA mesh's GPU).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weights = DTensor.from_local(torch.arange(4.0), mesh, [Shard(0)], run_check=False)
        stager = Stager()
        first = stager.stage({"w": weights}).tensors["w"]
        second = stager.stage({"w": weights}).tensors["w"]
        assert isinstance(first, DTensor) and isinstance(second, DTensor)
        assert second.placements == weights.placements
        assert second.device_mesh == mesh and second.shape == weights.shape
        assert second.to_local().data_ptr() == first.to_local().data_ptr()  # reused buffer
        assert second.to_local().data_ptr() != weights.to_local().data_ptr()
        assert second.to_local().tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


def test_buffers_reserved_ahead_are_the_ones_the_first_save_copies_into() -> None:
    stager = Stager()
    weights, bias = torch.arange(6.0), torch.zeros(2)
    assert stager.reserve({"w": weights, "b": bias})  # made on a thread of its own
    assert stager.nbytes == 8 * 4  # waits for that thread
    reserved = stager.stage({"w": weights, "b": bias}).tensors
    assert not stager.reserve({"w": weights, "b": bias})  # nothing left to make
    again = stager.stage({"w": weights + 1, "b": bias}).tensors
    assert again["w"].data_ptr() == reserved["w"].data_ptr()
    assert again["w"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert stager.reserve({"w": torch.zeros(3)})  # another shape: made anew
    assert stager.stage({"w": torch.ones(3)}).tensors["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_checkpointer_reserves_staging_once_and_only_for_async_saves(tmp_path: Path) -> None:
    def state() -> dict:
        return {"model": {"w": torch.zeros(4)}}

    assert not Checkpointer(str(tmp_path / "never"), every_steps=0).reserve_staging(state)
    assert not Checkpointer(str(tmp_path / "sync"), every_steps=5,
                            async_save=False).reserve_staging(state)
    checkpointer = Checkpointer(str(tmp_path / "async"), every_steps=5)
    assert checkpointer.reserve_staging(state)
    assert not checkpointer.reserve_staging(lambda: {"model": {"w": torch.zeros(8)}})


def test_a_reserve_in_the_calling_thread_is_done_when_it_returns() -> None:
    stager = Stager()
    assert stager.reserve({"w": torch.arange(6.0)}, background=False)
    assert stager._reserving is None  # no thread to wait for: a standby's build is done
    assert stager.nbytes == 6 * 4


def test_the_run_checkpointer_takes_the_staging_a_standby_reserved(tmp_path: Path) -> None:
    weights = torch.arange(4.0)
    user = Checkpointer(str(tmp_path / "ckpt"), every_steps=5)
    assert user.reserve_staging(lambda: {"model": {"w": weights}}, background=False)
    run = user.for_run(pointer=None, events=None,  # type: ignore[arg-type]
                       collective_timeout=timedelta(seconds=30), round_of=lambda: None)
    assert run._stager.nbytes == 4 * 4
    assert not run.reserve_staging(lambda: {"model": {"w": weights}})  # made already
    assert user._stager.nbytes == 0  # handed over, not shared


def _standby(checkpoint: Checkpointer | None, max_steps: int) -> SimpleNamespace:
    """A standby worker's loop as ``_ElasticLoop._prepare`` reads it: no round yet, one rank
    on this node, a replicated trainer of an 80-byte model and SGD with momentum."""
    def build(layout: Any) -> TrainState:
        model = torch.nn.Linear(4, 4)
        return TrainState(model=model,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    return SimpleNamespace(
        env=SimpleNamespace(in_round=False, max_nodes=0, node_id="c", local_world_size=1),
        options=RunOptions(max_steps=max_steps, global_batch_size=4),
        trainer=ReplicatedTrainer(build, lambda state, batch: torch.zeros(()), StepOptions()),
        _user_checkpoint=checkpoint)


def test_a_standby_worker_makes_the_first_saves_staging_before_it_registers(
        tmp_path: Path) -> None:
    no_round = SimpleNamespace(registry=SimpleNamespace(current_round=lambda: None))
    checkpoint = Checkpointer(str(tmp_path / "ckpt"), every_steps=5)
    _ElasticLoop._prepare(_standby(checkpoint, max_steps=10), no_round)  # type: ignore[arg-type]
    # weights, bias and their momentum buffers: every byte before the round, none by a thread
    assert checkpoint._stager._reserving is None and checkpoint._stager.nbytes == 2 * 20 * 4
    never = Checkpointer(str(tmp_path / "later"), every_steps=50)  # no save within the run
    _ElasticLoop._prepare(_standby(never, max_steps=10), no_round)  # type: ignore[arg-type]
    assert never._stager.nbytes == 0
