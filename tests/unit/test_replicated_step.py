"""The runtime's step around the user's: errors told apart, optimizer state created quietly,
scaler and scheduler state carried, options checked."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from elastic_rt.errors import ConfigError, UserCodeError
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.failures import is_peer_failure, user_code
from elastic_rt.worker.trainers.runtime_step import (
    ReplicatedStep,
    StepOptions,
    initialize_optimizer_state,
)

GLOO_PEER_DIED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                  "by peer [127.0.0.1]:42920. This is typically caused by a remote worker "
                  "crashing.")


@pytest.mark.parametrize("exc", [
    RuntimeError(GLOO_PEER_DIED),
    dist.DistBackendError("NCCL communicator was aborted"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                 "waiting 600000ms for recv operation to complete"),
])
def test_a_failed_collective_is_a_peer_failure(exc: BaseException) -> None:
    assert is_peer_failure(exc)
    with pytest.raises(type(exc)):
        with user_code(rank=0, step=3):
            raise exc


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x31 and 32x64)"),
    KeyError("label"),
    ValueError("Expected input batch_size (3) to match target batch_size (4)."),
])
def test_an_error_in_user_code_becomes_one_line_with_rank_and_step(exc: Exception) -> None:
    assert not is_peer_failure(exc)
    with pytest.raises(UserCodeError) as raised:
        with user_code(rank=2, step=7):
            raise exc
    assert str(raised.value).startswith(f"rank 2 failed at step 7: {type(exc).__name__}: ")
    assert "\n" not in str(raised.value)
    assert raised.value.__cause__ is exc


def test_optimizer_state_is_created_without_running_step_hooks() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    handle = register_optimizer_step_post_hook(
        lambda *_: calls.append("global"))
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert initialize_optimizer_state(optimizer) is True
        assert initialize_optimizer_state(optimizer) is False  # already there
    finally:
        handle.remove()
    assert calls == []
    assert set(optimizer.state[model.weight]) >= {"exp_avg", "exp_avg_sq", "step"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # lr was 0
    assert [g["lr"] for g in optimizer.param_groups] == [0.1]
    assert model.weight.grad is None  # gradients put back
    assert scheduler.last_epoch == 0


def test_step_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="autocast_dtype"):
        StepOptions(autocast_dtype=torch.float64)
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        StepOptions(clip_grad_norm=0.0)


def test_the_scaler_state_travels_as_json() -> None:
    model = torch.nn.Linear(4, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    sender = ReplicatedStep(state, lambda s, b: s.model(b).mean(),
                            StepOptions(autocast_dtype=torch.float16))
    assert sender.scaler is not None
    sender.scaler.scale(torch.tensor(1.0))
    sender.scaler.update(new_scale=512.0)
    receiver = ReplicatedStep(state, lambda s, b: s.model(b).mean(),
                              StepOptions(autocast_dtype=torch.float16))
    receiver.load_runtime_state(json.loads(json.dumps(sender.runtime_state())))
    assert receiver.scaler is not None and receiver.scaler.get_scale() == 512.0
