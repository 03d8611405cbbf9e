"""Two gloo processes: DTensor resharding across world sizes, and all-or-nothing saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from elastic_rt.checkpoint import Checkpointer
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

FULL = torch.arange(24.0).reshape(6, 4)


def _worker(env: WorkerEnv, url: str, single_url: str, options: dict) -> dict[str, Any]:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    mesh = init_device_mesh("cpu", (env.nprocs,))
    rows = FULL.shape[0] // env.nprocs
    shard = FULL[env.rank * rows:(env.rank + 1) * rows].clone()
    ckpt = Checkpointer(url, storage_options=options)
    outcome: dict[str, Any] = {}

    # A rank that cannot save fails the save on every rank, and nobody hangs.
    bad = {"w": torch.zeros(1)} if env.rank == 0 else {"w": torch.zeros(1), "x": object()}
    try:
        ckpt.save(1, bad)
        ckpt.wait()
    except Exception as exc:  # collected for the test to compare across ranks
        outcome["failure"] = type(exc).__name__

    # Saved sharded over 2 ranks, with a replicated tensor and per-rank (stage) keys.
    state = {"tp": DTensor.from_local(shard, mesh, [Shard(0)], run_check=False),
             "rep": torch.full((3,), 7.0), f"stage{env.rank}": torch.full((2,), float(env.rank)),
             "epoch": 5}
    ckpt.save(2, state, layout={"dp": 1, "tp": env.nprocs})
    outcome["saved"] = ckpt.wait().name  # type: ignore[union-attr]

    # Saved by one process, loaded into 2 shards.
    target = {"tp": DTensor.from_local(torch.zeros(rows, 4), mesh, [Shard(0)], run_check=False)}
    Checkpointer(single_url, storage_options=options).load(target)
    outcome["local"] = target["tp"].to_local()
    ckpt.close()
    dist.destroy_process_group()
    return outcome


def _roundtrip(url: str, single_url: str, options: dict) -> None:
    single = Checkpointer(single_url, storage_options=options, async_save=False)
    single.save(1, {"tp": FULL.clone()})
    results = run_workers(_worker, 2, args=(url, single_url, options), timeout_s=90)

    assert [r["failure"] for r in results] == ["ConfigError", "ConfigError"]
    assert torch.equal(torch.cat([r["local"] for r in results]), FULL)

    state: dict[str, Any] = {"tp": torch.zeros(6, 4), "rep": torch.zeros(3),
                             "stage0": torch.zeros(2), "stage1": torch.zeros(2), "epoch": 0}
    info = Checkpointer(url, storage_options=options).load(state)
    assert info.name == results[0]["saved"] and info.layout == {"dp": 1, "tp": 2}
    assert torch.equal(state["tp"], FULL) and torch.all(state["rep"] == 7.0)
    assert torch.all(state["stage1"] == 1.0) and state["epoch"] == 5
    assert [i.committed for i in Checkpointer(url, storage_options=options).list()] == [True]


def test_dtensor_saved_on_two_ranks_loads_on_one_and_back_on_file(tmp_path: Path) -> None:
    _roundtrip(f"file://{tmp_path}/two", f"file://{tmp_path}/one", {})


@pytest.mark.s3
def test_dtensor_saved_on_two_ranks_loads_on_one_and_back_on_s3(
        s3_server: dict[str, Any], s3_url: str) -> None:
    _roundtrip(f"{s3_url}/two", f"{s3_url}/one", s3_server)
