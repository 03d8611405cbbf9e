"""FSDP with gradient accumulation and bf16 mixed precision, on two gloo ranks.

The global batch of 5 splits 3 / 2 over the ranks, so with ``micro_batch_size=2`` rank 0
runs two micro-batches a step and rank 1 one: FSDP's collectives still pair up rank for
rank (one all-gather, one reduce-scatter a step; ``sharded/fsdp.ShardedGradients``), and
the result equals one process training on the whole batch. Under bf16
(``MixedPrecisionPolicy``) the parameters stay float32 shards and land near the fp32 run.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import elastic_rt as ert
from elastic_rt.etcd_server import free_port
from elastic_rt.layout import Layout, ModelLimits
from tests.fixtures.fsdp_reference import train_alone
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

STEPS, GLOBAL_BATCH, WIDTH = 6, 5, 8


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(WIDTH), torch.randn(1)) for _ in range(GLOBAL_BATCH * 4)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _build(layout: Layout) -> ert.TrainState:
    model = _model()
    return ert.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def _step(state: ert.TrainState, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(state.model(x).float(), y)


def _train(env: WorkerEnv, port: int, dtype: str | None) -> dict[str, Any]:
    os.environ.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.nprocs),
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    state = ert.run(build=_build, step=_step, dataset=_data(), global_batch_size=GLOBAL_BATCH,
                    max_steps=STEPS, micro_batch_size=2, limits=ModelLimits(max_shard=2),
                    autocast_dtype=getattr(torch, dtype) if dtype else None)
    params = dict(state.model.named_parameters())
    return {"shards": {name: p.to_local().detach().clone() for name, p in params.items()},
            "dtypes": sorted({str(p.dtype) for p in params.values()})}


def _reference() -> dict[str, torch.Tensor]:
    return train_alone(_model(), _data(), steps=STEPS, global_batch=GLOBAL_BATCH)


def _joined(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """FSDP2 shards dim 0 in torch.chunk's pieces, rank by rank."""
    return {name: torch.cat([rank["shards"][name] for rank in ranks])
            for name in ranks[0]["shards"]}


@pytest.mark.parametrize(("dtype", "atol"), [(None, 1e-5), ("bfloat16", 3e-2)])
def test_uneven_micro_batch_counts_under_fsdp_end_like_one_process(dtype: str | None,
                                                                   atol: float) -> None:
    ranks = run_workers(_train, 2, args=(free_port(), dtype), timeout_s=120)
    got, want = _joined(ranks), _reference()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)
    # mixed precision computes in bf16 but the optimizer's shards stay float32
    assert all(rank["dtypes"] == ["torch.float32"] for rank in ranks)
    if dtype:  # and bf16 did change the numbers (the policy was applied)
        assert any(not torch.equal(got[n], want[n]) for n in want)
