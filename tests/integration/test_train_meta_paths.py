"""A field added to TrainMeta reaches every rank over gloo: replica, checkpoint, FSDP restores.

Two worker processes (``tests/fixtures/meta_paths.py``): rank 0's record, with the added
field, must be what rank 1's restore applies on each path (rank 0 keeps its own on the
replica path), and no trainer knows the field.
"""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.meta_paths import run_paths
from tests.fixtures.torchdist import run_workers


def test_rank_zeros_added_field_reaches_the_other_rank_on_every_path(tmp_path: Path) -> None:
    results = run_workers(run_paths, 2, args=(tmp_path.as_uri(),), timeout_s=120)
    for rank, got in enumerate(results):
        assert got == {
            # rank 0 holds the state and keeps it; rank 1 receives rank 0's record
            "replica": ["rank 0", "held by rank 0" if rank else None, 5],
            "replicated checkpoint": ["checkpoint", "saved by rank 0", 5],
            "sharded": ["replicas", "piece of rank 0", 7],
            "sharded checkpoint": ["checkpoint", "sharded save by rank 0", 7],
        }
