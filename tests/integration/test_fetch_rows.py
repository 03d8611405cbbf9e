"""row_fetch.fetch_rows in real gloo processes: each rank's tensors get exactly its new rows.

Three ranks hold the four pieces of an old cut (rank 0 two of them, as a rank holding its
own piece and a neighbour's copy does) and restore to new cuts of three, of two replicated
(HSDP-like) and of one (plain replicas), with tensors whose rows do not divide evenly and of
two dtypes.
"""

from __future__ import annotations

import pytest
import torch

from elastic_rt.worker.trainers.sharded.fsdp import RowSpec
from elastic_rt.worker.trainers.sharded.row_fetch import Sources, fetch_rows
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

SPECS = [RowSpec("optim_rows", "w\0exp_avg", (10, 3), torch.float32),
         RowSpec("params", "b", (5,), torch.bfloat16),
         RowSpec("params", "w", (10, 3), torch.float32)]
OLD = Sources(step=7, ranks=(0, 1, 2, 0))  # piece i is read on rank ranks[i]
NEW_CUTS = {"fsdp3": [(3, 0), (3, 1), (3, 2)], "hsdp": [(2, 0), (2, 1), (2, 0)],
            "replicas": [(1, 0)] * 3}


def _full(spec: RowSpec) -> torch.Tensor:
    return torch.arange(torch.Size(spec.shape).numel()).reshape(spec.shape).to(spec.dtype)


def _old_piece(index: int) -> dict[str, object]:
    piece: dict[str, object] = {"params": {}, "optim_rows": {}, "buffers": {"n": torch.ones(2)},
                                "optim_whole": {"w\0step": torch.tensor(7.0)},
                                "groups": [{"lr": 0.1, "params": ["w", "b"]}]}
    for spec in SPECS:
        chunks = list(torch.chunk(_full(spec), OLD.count))
        chunks += [_full(spec)[:0]] * (OLD.count - len(chunks))
        piece[spec.side][spec.key] = chunks[index]  # type: ignore[index]
    return {"piece": piece, "meta": {"step": 7} if index == 0 else {}}


def _restore_every_cut(env: WorkerEnv) -> dict[str, object]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    try:
        world = dist.group.WORLD
        assert world is not None
        out: dict[str, object] = {}
        for name, wants in NEW_CUTS.items():
            count, index = wants[env.rank]
            expected = [(list(torch.chunk(_full(spec), count)) + [_full(spec)[:0]] * count)[index]
                        for spec in SPECS]
            targets = [(spec, torch.full_like(rows, -1)) for spec, rows in zip(SPECS, expected)]
            whole, meta = fetch_rows(OLD, _old_piece, world, wants, targets)
            out[name] = (all(torch.equal(got, want) for (_, got), want in zip(targets, expected))
                         and meta == {"step": 7} and whole["groups"][0]["lr"] == 0.1
                         and "params" not in whole)
        return out
    finally:
        dist.destroy_process_group()


def test_each_rank_receives_exactly_the_rows_of_its_new_piece() -> None:
    results = run_workers(_restore_every_cut, 3, timeout_s=60)
    assert results == [{name: True for name in NEW_CUTS}] * 3, results
