"""FSDP / HSDP composed with the runtime's pipeline and tensor parallelism, in real gloo
processes: ``fsdp2xtp2`` and ``pp2xfsdp2`` train the parameters of one float64 process, and
the state moves by name between sharded and unsharded cuts (an FSDP shard of a tensor-parallel
piece is a box of the whole tensor, ``_StridedShard`` included)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastic_rt.harness import described_model as dm
from tests.fixtures.torchdist import WorkerEnv, run_workers
from tests.integration.test_runtime_parallel import GLOBAL_BATCH, SAMPLES, _check, _rounds

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout, options, micro", [
    ({"dp": 2, "tp": 2, "shard": 2}, {}, None),
    ({"dp": 2, "pp": 2, "shard": 2}, {"schedule": "1F1B"}, 2),
], ids=["fsdp2xtp2", "pp2xfsdp2"])
def test_a_sharded_model_parallel_layout_trains_the_parameters_of_one_process(
        layout: dict[str, int], options: dict[str, Any], micro: int | None) -> None:
    results = run_workers(_rounds, 4, args=([(layout, 3)], options, micro), timeout_s=90)
    _check(results, 3)
    assert {s for r in results for s in r["sources"]} == {"init"}


def test_sharded_and_unsharded_cuts_take_the_state_by_name_from_each_other() -> None:
    # fsdp2xtp2 -> pp2xdp2 -> fsdp4 (pp1 tp1) and back, then pp2xfsdp2 and hsdp2x2
    rounds = [({"dp": 2, "tp": 2, "shard": 2}, 2), ({"dp": 2, "pp": 2}, 2),
              ({"dp": 4, "shard": 4}, 1), ({"dp": 2, "pp": 2}, 1),
              ({"dp": 2, "tp": 2, "shard": 2}, 1), ({"dp": 2, "pp": 2, "shard": 2}, 1),
              ({"dp": 4, "shard": 2}, 1)]
    results = run_workers(_rounds, 4, args=(rounds, {}, None), timeout_s=120)
    _check(results, 9)
    assert results[0]["sources"] == ["init"] + ["survivors"] * 6


def test_hsdp_with_tp_and_pp_trains_and_moves_by_name_on_8_ranks() -> None:
    # hsdp2x2xtp2: each tp piece sharded 2 ways, 2 replicas; then pp2xhsdp2x2
    rounds = [({"dp": 4, "tp": 2, "shard": 2}, 2), ({"dp": 4, "pp": 2, "shard": 2}, 1)]
    results = run_workers(_rounds, 8, args=(rounds, {}, None), timeout_s=180)
    _check(results, 3)
    assert results[0]["sources"] == ["init", "survivors"]


@pytest.mark.parametrize("layout", [
    {"dp": 2, "tp": 2, "shard": 2}, {"dp": 2, "pp": 2, "shard": 2},
], ids=["fsdp2xtp2", "pp2xfsdp2"])
def test_clipping_uses_the_whole_models_norm_in_every_layout(layout: dict[str, int]) -> None:
    # tp and FSDP pieces (_StridedShard), pipeline stages and FSDP pieces (an unsharded
    # pp2xdp2 adds nothing to these two). 0.05 is below every step's gradient norm here:
    # every step clips
    results = run_workers(_rounds, 4, args=([(layout, 3)], {}, None, None, 1, 0.05),
                          timeout_s=90)
    _check(results, 3, clip=0.05)


def _counted(env: WorkerEnv, *args: Any) -> dict[str, Any]:
    """``_rounds``, counting on this rank the micro-batches' losses (one per forward) and
    the reduce-scatters FSDP issues."""
    from unittest import mock

    import torch.distributed as dist

    from elastic_rt.worker.trainers.runtime_parallel.trainer import (
        RuntimeParallelTrainer as Trainer,
    )

    # FSDP looks the collective up on the module at each call
    with mock.patch.object(dist, "reduce_scatter_single",
                           wraps=dist.reduce_scatter_single) as reduces, \
            mock.patch.object(Trainer, "_loss", autospec=True,
                              side_effect=Trainer._loss) as losses:
        result = _rounds(env, *args)
    return {**result, "reduce_scatters": reduces.call_count, "losses": losses.call_count}


@pytest.mark.parametrize("layout, counts", [
    ({"dp": 2, "tp": 2, "shard": 2}, [2] * 4),  # shares of 4: 2 micro-batches each
    ({"dp": 3, "shard": 3}, [2, 2, 1]),  # shares of 3, 3 and 2
], ids=["fsdp2xtp2", "fsdp3-uneven"])
def test_micro_batches_accumulate_under_fsdp_and_reduce_once_per_step(
        layout: dict[str, int], counts: list[int]) -> None:
    results = run_workers(_counted, len(counts), args=([(layout, 3)], {}, 2), timeout_s=90)
    _check(results, 3)
    assert [r["losses"] for r in results] == [3 * n for n in counts]  # a forward each
    # 5 FSDP units (4 blocks, the stage root), each reduced once in each of 3 steps
    assert [r["reduce_scatters"] for r in results] == [5 * 3] * len(counts)


def test_bfloat16_trains_sharded_by_fsdps_policy_and_unsharded_under_autocast() -> None:
    # fsdp2xtp2 (FSDP's MixedPrecisionPolicy, micro-batches accumulated), pp2xfsdp2 (the
    # policy under the schedule), then pp2xtp2 (autocast around the schedule's step), on a
    # float32 model
    rounds = [({"dp": 2, "tp": 2, "shard": 2}, 2), ({"dp": 2, "pp": 2, "shard": 2}, 1),
              ({"dp": 1, "pp": 2, "tp": 2}, 1)]
    results = run_workers(_rounds, 4, args=(rounds, {}, 2, None, 1, None, torch.bfloat16),
                          timeout_s=120)
    assert results[0]["sources"] == ["init", "survivors", "survivors"]
    got = {name: p.detach() for r in results for name, p in r["params"].items()}
    assert {p.dtype for p in got.values()} == {torch.float32}  # the master copy
    want = dm.reference_params(4, samples=SAMPLES, global_batch=GLOBAL_BATCH)
    start = dm.reference_params(0, samples=SAMPLES, global_batch=GLOBAL_BATCH)
    assert set(got) == set(want)
    off = sum(float((got[n].double() - want[n]).norm()) ** 2 for n in want) ** 0.5
    moved = sum(float((want[n] - start[n]).norm()) ** 2 for n in want) ** 0.5
    # one process under bfloat16 autocast is off the float64 run by 0.17 of the
    # distance the parameters moved in these 4 steps (AdamW's steps of 0.05)
    assert off / moved < 0.35
