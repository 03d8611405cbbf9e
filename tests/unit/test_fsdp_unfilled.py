"""A state restored from pieces is built on the meta device, unless that could change it.

Every value of such a state is overwritten from the pieces, so initializing the whole model
on every rank first only costs time and memory (0.4 GB per rank at 100M parameters). A build
that cannot run on meta, or leaves a tensor that ``to_empty`` would not give memory to, must
be built for real instead: the check has to catch each such build, or the job would train on
meta tensors (an error at the first step) or on tensors never filled.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.sharded.fsdp import build_unfilled, materialize


class _Tabled(torch.nn.Module):
    """Holds a lookup table in a plain attribute, as some rotary-embedding code does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.table = torch.arange(4.0)


def _plain() -> TrainState:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 1))
    model.register_buffer("seen", torch.zeros(2), persistent=False)
    return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))


def _reads_a_value() -> TrainState:
    state = _plain()
    first: Any = next(iter(state.model.children()))
    torch.nn.init.constant_(first.bias, float(first.weight.abs().max()))  # a value: not on meta
    return state


def _own_device() -> TrainState:
    model = torch.nn.Linear(4, 4, device="cpu")
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _plain_attribute() -> TrainState:
    model = _Tabled()
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _tensor_lr() -> TrainState:
    model = torch.nn.Linear(4, 4)
    return TrainState(model=model,
                      optimizer=torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1)))


def test_a_plain_build_runs_on_meta_and_its_optimizer_follows_it_onto_memory() -> None:
    state = build_unfilled(_plain)
    assert state is not None
    assert all(t.is_meta for t in [*state.model.parameters(), *state.model.buffers()])
    materialize(state)
    assert [id(p) for group in state.optimizer.param_groups for p in group["params"]] \
        == [id(p) for p in state.model.parameters()]  # the optimizer steps the new ones
    # its state is keyed by the new parameters too
    assert {id(p) for p in state.optimizer.state} == {id(p) for p in state.model.parameters()}
    moments = [v for entry in state.optimizer.state.values() for v in entry.values()
               if isinstance(v, torch.Tensor)]
    assert len(moments) == 3 * len(list(state.model.parameters()))  # made on meta, then filled
    filled = [*state.model.parameters(), *state.model.buffers(), *moments]
    assert all(t.device.type == "cpu" for t in filled)
    state.model(torch.ones(2, 4)).sum().backward()  # trains once filled
    state.optimizer.step()


@pytest.mark.parametrize("build", [_reads_a_value, _own_device, _plain_attribute, _tensor_lr],
                         ids=["reads-a-value", "own-device", "plain-attribute", "tensor-lr"])
def test_a_build_meta_cannot_stand_in_for_is_built_for_real(
        build: Callable[[], Any]) -> None:
    assert build_unfilled(build) is None


def test_a_state_built_for_real_is_left_as_it_is() -> None:
    state = _plain()
    before = [p.detach().clone() for p in state.model.parameters()]
    materialize(state)
    for param, old in zip(state.model.parameters(), before):
        torch.testing.assert_close(param.detach(), old, rtol=0, atol=0)
