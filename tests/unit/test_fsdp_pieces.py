"""A rank's FSDP piece can be read after its step failed anywhere, mid-forward included.

A peer lost while the survivors were inside FSDP's forward left the root's gathered
parameters registered (the root keeps them through forward), so reading the piece
raised ``KeyError`` on every survivor, their restore failed, and with no checkpoint the
job started over from step 0. Two gloo ranks, a model with a parameter on its root.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.runtime_step import initialize_optimizer_state
from elastic_rt.worker.trainers.sharded.fsdp import (
    local_piece,
    put_shards_back,
    shard_train_state,
)
from tests.fixtures.torchdist import WorkerEnv, run_workers


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))  # owned by the root
        self.inner = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x * self.scale)))


class _PeerLost(RuntimeError):
    """What a collective raises when its peer dies (stands in for gloo's error)."""


def _fail_then_read(env: WorkerEnv, where: str) -> dict[str, object]:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    torch.manual_seed(0)
    model = _Net()
    state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
    shard_train_state(state, init_device_mesh("cpu", (env.nprocs,)))
    initialize_optimizer_state(state.optimizer)
    state.model(torch.ones(4, 8)).sum().backward()  # one good step
    state.optimizer.step()
    state.optimizer.zero_grad()
    before = local_piece(state)

    def lose_a_peer(*_: object) -> None:
        raise _PeerLost("the all-gather's peer died")

    head: torch.nn.Module = state.model.head  # type: ignore[assignment]
    hook = (head.register_forward_pre_hook(lose_a_peer, prepend=True) if where == "mid-forward"
            else None)
    try:
        loss = state.model(torch.ones(4, 8)).sum()
        if where == "after-forward":
            raise _PeerLost("the backward's reduce-scatter peer died")
        loss.backward()
    except _PeerLost:
        pass
    if hook is not None:
        hook.remove()
    put_shards_back(state.model)
    after = local_piece(state)
    dist.destroy_process_group()
    return {"before": before["params"], "after": after["params"],
            "optim_before": before["optim_rows"], "optim_after": after["optim_rows"]}


def test_a_step_that_failed_mid_forward_leaves_the_last_committed_piece_readable() -> None:
    for where in ("mid-forward", "after-forward"):
        for result in run_workers(_fail_then_read, 2, args=(where,)):
            assert sorted(result["after"]) == ["head.bias", "head.weight", "inner.bias",
                                               "inner.weight", "scale"], where
            for name, shard in result["before"].items():
                torch.testing.assert_close(result["after"][name], shard, rtol=0, atol=0)
            for name, rows in result["optim_before"].items():
                torch.testing.assert_close(result["optim_after"][name], rows, rtol=0, atol=0)
