"""``run(on_step=...)`` outside ``elastic-rt launch``: one report per committed step, whose
loss is the global batch's mean over every data-parallel rank's samples."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import elastic_rt as ert
from elastic_rt.etcd_server import free_port
from elastic_rt.layout import Layout
from elastic_rt.worker.progress import StepReport
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

STEPS = 4


def _build(layout: Layout) -> ert.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return ert.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _step(state: ert.TrainState, batch: Any) -> torch.Tensor:
    x, y = batch
    return (state.model(x) - y).pow(2).mean()


def _train(env: WorkerEnv, port: int) -> list[dict[str, float]]:
    os.environ.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.nprocs),
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.manual_seed(1)
    data = [(torch.randn(3), torch.randn(1)) for _ in range(12)]
    reports: list[StepReport] = []
    ert.run(build=_build, step=_step, dataset=data, global_batch_size=6, max_steps=STEPS,
            on_step=reports.append)
    return [{"step": r.step, "loss": r.loss, "local": r.local_loss, "world": r.world_size}
            for r in reports]


def test_on_step_reports_each_committed_step_once_with_the_global_mean_loss() -> None:
    ranks = run_workers(_train, 2, args=(free_port(),), timeout_s=90)
    for reports in ranks:
        assert [r["step"] for r in reports] == list(range(1, STEPS + 1))
        assert all(r["world"] == 2 for r in reports)
    for mine, theirs in zip(*ranks):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)  # one global value
        # equal shares (3 samples each): the global mean is the mean of the local ones
        assert mine["loss"] == pytest.approx((mine["local"] + theirs["local"]) / 2, abs=1e-5)
