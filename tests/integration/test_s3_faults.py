"""S3 faults on the wire: a proxy between s3fs and moto answers chosen requests with
S3 errors or drops the connection (see ``tests/fixtures/s3.py``)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.errors import CheckpointError
from tests.fixtures.s3 import S3_BUCKET, FaultyProxy
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.s3

# Few attempts, so that a fault that never clears fails in seconds rather than minutes.
FEW_RETRIES = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}


def _url() -> str:
    return f"s3://{S3_BUCKET}/faults-{uuid.uuid4().hex[:8]}"


def test_transient_errors_on_save_and_load_are_retried(
        faulty_s3: tuple[dict[str, Any], FaultyProxy]) -> None:
    options, proxy = faulty_s3
    url = _url()
    proxy.add("PUT", r"\.distcp$", 503)            # a data file upload: SlowDown
    proxy.add("PUT", r"/\.metadata$", "reset")      # DCP's metadata: connection dropped
    proxy.add("PUT", r"manifest\.json$", 500)       # the commit itself: InternalError
    proxy.add("GET", r"list-type=2", 503)           # the restore's listing
    proxy.add("GET", r"manifest\.json$", "reset")   # the restore's manifest read
    proxy.add("GET", r"\.distcp$", 500)             # a data file download
    state: dict[str, Any] = {"w": torch.randn(64, 32), "b": torch.arange(10.0), "epoch": 3}

    saver = Checkpointer(url, storage_options=options, async_save=False)
    saver.save(1, state)
    target: dict[str, Any] = {"w": torch.zeros(64, 32), "b": torch.zeros(10), "epoch": 0}
    info = Checkpointer(url, storage_options=options).load(target)

    assert info.step == 1
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["epoch"] == 3
    assert all(fault.times == 0 for fault in proxy.faults), proxy.faults
    broken = proxy.broken()
    assert len(broken) == 6
    for method, path, _ in broken:  # each broken request was made again and succeeded
        later = proxy.log[proxy.log.index((method, path, _)) + 1:]
        assert any(m == method and p == path and s in (200, 206) for m, p, s in later), path


def test_a_fault_that_never_clears_fails_the_save_and_keeps_the_last_checkpoint(
        faulty_s3: tuple[dict[str, Any], FaultyProxy]) -> None:
    options, proxy = faulty_s3
    options = {**options, **FEW_RETRIES}
    url = _url()
    ckpt = Checkpointer(url, storage_options=options, async_save=False)
    ckpt.save(1, {"w": torch.ones(8)})
    proxy.add("PUT", r"\.distcp$", 500, times=-1)

    started = time.monotonic()
    with pytest.raises(CheckpointError, match="InternalError|500"):
        ckpt.save(2, {"w": torch.full((8,), 2.0)})
    assert time.monotonic() - started < 60

    listed = Checkpointer(url, storage_options=options).list()
    assert [(i.step, i.committed) for i in listed if i.committed] == [(1, True)]
    target = {"w": torch.zeros(8)}
    assert Checkpointer(url, storage_options=options).load(target).step == 1
    assert torch.equal(target["w"], torch.ones(8))


def _save_on_two_ranks(env: WorkerEnv, url: str, options: dict) -> str:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    ckpt = Checkpointer(url, storage_options=options, async_save=False)
    try:
        ckpt.save(1, {f"rank{env.rank}": torch.full((256,), float(env.rank))})
        return "saved"
    except CheckpointError as exc:
        return f"failed: {exc}"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_storage_failure_on_one_rank_fails_the_save_on_every_rank(
        faulty_s3: tuple[dict[str, Any], FaultyProxy]) -> None:
    options, proxy = faulty_s3
    options = {**options, **FEW_RETRIES}
    url = _url()
    proxy.add("PUT", r"/__1_\d+\.distcp$", 500, times=-1)  # only rank 1's data files

    outcomes = run_workers(_save_on_two_ranks, 2, args=(url, options), timeout_s=90)

    assert all(o.startswith("failed") for o in outcomes), outcomes
    assert "rank 1" in outcomes[0] or "InternalError" in outcomes[0], outcomes[0]
    assert not [i for i in Checkpointer(url, storage_options=options).list() if i.committed]
