"""TrainMeta: one encoding for the state beside the tensors, and a new field reaching every path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers import StepOptions, TrainMeta
from elastic_rt.worker.trainers.runtime_step import ReplicatedStep
from tests.fixtures.meta_paths import run_paths
from tests.fixtures.torchdist import WorkerEnv

KEYS = {"step", "sampler", "extras", "scheduler", "runtime"}


def _state(lr: float = 0.1) -> TrainState:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, extras={"seen": 3})


def _sampler(advanced: int = 0) -> ElasticSampler:
    sampler = ElasticSampler(40, global_batch_size=4, seed=1)
    for _ in range(advanced):
        sampler.advance()
    return sampler


def test_the_encoding_is_the_checkpoints_extra_layout_and_survives_json() -> None:
    state = _state()
    state.optimizer.step()
    state.scheduler.step()  # type: ignore[union-attr]
    meta = TrainMeta.capture(step=4, sampler=_sampler(2), state=state,
                             stepper=ReplicatedStep(state, lambda s, b: b, StepOptions()))
    encoded = meta.encode()
    assert set(encoded) == KEYS
    assert encoded["step"] == 4 and encoded["extras"] == {"seen": 3}
    assert encoded["sampler"] == _sampler(2).state_dict() and encoded["runtime"] == {}
    assert TrainMeta.decode(json.loads(json.dumps(encoded))) == meta


def test_capture_then_apply_moves_extras_and_scheduler_into_a_fresh_state() -> None:
    trained = _state()
    for _ in range(3):
        trained.optimizer.step()
        trained.scheduler.step()  # type: ignore[union-attr]
    meta = TrainMeta.decode(json.loads(json.dumps(
        TrainMeta.capture(step=3, sampler=_sampler(3), state=trained).encode())))
    fresh = _state()
    fresh.extras = {}
    meta.apply(state=fresh)
    assert fresh.extras == {"seen": 3}
    assert fresh.scheduler is not None and fresh.scheduler.last_epoch == 3
    assert trained.scheduler is not None
    assert fresh.scheduler.get_last_lr() == trained.scheduler.get_last_lr()


@pytest.mark.parametrize("extra", [
    {"step": 9, "sampler": {"epoch": 0, "position": 36}, "extras": {"k": 1}},  # owned step
    {"step": 9, "sampler": {"epoch": 0, "position": 36}, "extras": {}, "runtime": {}},  # no LR
])
def test_an_older_checkpoints_extra_still_decodes(extra: dict[str, Any]) -> None:
    meta = TrainMeta.decode(extra)
    assert meta.step == 9 and meta.sampler == extra["sampler"]
    assert meta.extras == extra["extras"] and meta.scheduler is None and meta.runtime == {}


def test_decoding_names_a_missing_field_without_a_default() -> None:
    with pytest.raises(KeyError, match="sampler"):
        TrainMeta.decode({"step": 1})


def test_an_object_owning_its_step_keeps_its_extras_and_gets_nothing_loaded() -> None:
    class Stage:
        extras = {"stage": 1}
        scheduler = "not a TrainState's"

    meta = TrainMeta.capture(step=2, sampler=_sampler(), state=Stage())
    assert meta.extras == {"stage": 1} and meta.scheduler is None and meta.runtime == {}
    stage = Stage()
    TrainMeta(step=2, sampler={}, extras={"other": 2}).apply(state=stage)
    assert stage.extras == {"stage": 1}


def test_a_field_added_to_train_meta_reaches_the_checkpoint_and_both_restores(
        tmp_path: Path) -> None:
    # One rank, in this process: the real trainers and groups, the transport trivial.
    assert not dist.is_initialized()
    got = run_paths(WorkerEnv(rank=0, nprocs=1, store=dist.HashStore()), tmp_path.as_uri())
    assert got == {
        "replica": ["kept", None, 5],  # the only rank holds it: nothing moves
        "replicated checkpoint": ["checkpoint", "saved by rank 0", 5],
        "sharded": ["replicas", "piece of rank 0", 7],
        "sharded checkpoint": ["checkpoint", "sharded save by rank 0", 7],
    }
