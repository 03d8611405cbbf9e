"""Sequence parallelism from the description's plans, in real gloo processes: the
activations between blocks (and between pipeline stages) are each tensor-parallel rank's
slice of the sequence, the norms' weights are replicated DTensors whose gradients backward
leaves ``Partial``, and the training still equals one float64 process's, in every layout the
state then moves to by name."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.torchdist import WorkerEnv, run_workers
from tests.integration.test_runtime_parallel import _check, _rounds

pytestmark = pytest.mark.slow

CLIP = 0.05
"""Below every step's gradient norm here: every step clips, so the norm must count the
``Partial`` gradients once summed over tp."""


def _sequence_rounds(env: WorkerEnv, rounds: list[tuple[dict[str, int], int]],
                     options: dict[str, Any], clip: float | None) -> dict[str, Any]:
    """``_rounds`` with the sequence-parallel plans, one micro-batch per rank."""
    return _rounds(env, rounds, options, None, None, 1, clip, sequence_parallel=True)


@pytest.mark.parametrize("layout, options, clip", [
    ({"dp": 1, "tp": 2}, {}, CLIP),
    ({"dp": 1, "pp": 2, "tp": 2}, {"schedule": "1F1B"}, None),
], ids=["tp2-clipped", "pp2xtp2"])
def test_sequence_parallel_plans_train_the_parameters_of_one_process(
        layout: dict[str, int], options: dict[str, Any], clip: float | None) -> None:
    world = layout["dp"] * layout.get("pp", 1) * layout["tp"]
    results = run_workers(_sequence_rounds, world, args=([(layout, 3)], options, clip),
                          timeout_s=90)
    _check(results, 3, clip=clip)
    assert {s for r in results for s in r["sources"]} == {"init"}


def test_a_sequence_parallel_state_moves_by_name_to_fsdp_and_back_to_pipeline_cuts() -> None:
    # pp2xtp2 -> fsdp2xtp2 (FSDP2 settles the norms' Partial gradients itself) -> pp3 (tp1:
    # the plans are not applied, the same names hold whole tensors). Rank 3 is gone, and
    # its FSDP shard had no replica: it comes from the copy rank 0 holds
    rounds = [({"dp": 1, "pp": 2, "tp": 2}, 2), ({"dp": 2, "tp": 2, "shard": 2}, 2),
              ({"dp": 1, "pp": 3}, 1)]
    results = run_workers(_sequence_rounds, 4, args=(rounds, {}, None), timeout_s=120)
    _check(results, 5)
    assert results[0]["sources"] == ["init", "survivors", "peer copies"]
    assert results[3] == {"left": True}
