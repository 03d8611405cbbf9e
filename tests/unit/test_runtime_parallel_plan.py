"""The runtime-parallel family's pure parts: stage cuts, the description's checks, the
schedule's options and micro-batch counts, the choice of sources, the by-name piece plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from elastic_rt.errors import ConfigError, ElasticError
from elastic_rt.harness import described_model as dm
from elastic_rt.layout import ModelLimits
from elastic_rt.worker.trainers.model_parallel.part_broadcast import Holder
from elastic_rt.worker.trainers.runtime_parallel.by_name import (
    Entry,
    overlap,
    pieces_of,
    plan_moves,
)
from elastic_rt.worker.trainers.runtime_parallel.cut import cut_stages, stages_of_rank
from elastic_rt.worker.trainers.runtime_parallel.description import ModelDescription
from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel
from elastic_rt.worker.trainers.runtime_parallel.copy_sources import Choice, Copy, pick_sources
from elastic_rt.worker.trainers.runtime_parallel.stages import StageModule


@pytest.mark.parametrize("sizes, stages, first, last, want", [
    ([1, 1, 1, 1], 2, 0, 0, [(0, 2), (2, 4)]),
    ([1, 1, 1, 1], 4, 0, 0, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ([1, 1, 1, 1], 1, 0, 0, [(0, 4)]),
    ([5, 1, 1, 1], 2, 0, 0, [(0, 1), (1, 4)]),
    ([1, 1, 1, 1], 2, 3, 0, [(0, 1), (1, 4)]),   # a big embedding leaves stage 0 one block
    ([1, 1, 1, 1], 2, 0, 3, [(0, 3), (3, 4)]),   # a big head leaves the last stage one block
    ([1, 1, 1, 1, 1], 2, 0, 0, [(0, 2), (2, 5)]),  # ties: the earliest boundary
])
def test_blocks_are_cut_into_contiguous_stages_balanced_by_parameter_count(
        sizes: list[int], stages: int, first: int, last: int, want: list[tuple[int, int]]) -> None:
    cuts = cut_stages(sizes, stages, first=first, last=last)
    assert [(r.start, r.stop) for r in cuts] == want


def test_more_stages_than_blocks_is_one_config_error_line() -> None:
    with pytest.raises(ConfigError) as caught:
        cut_stages([1, 1], 3)
    assert "\n" not in str(caught.value) and "3 pipeline stages" in str(caught.value)


def test_interleaved_stages_loop_over_the_pipeline_ranks() -> None:
    assert stages_of_rank(1, 2, 2) == [1, 3]
    assert stages_of_rank(0, 4, 1) == [0]


def _model() -> nn.Module:
    model = nn.Module()
    model.embed = nn.Linear(2, 4)
    model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    model.head = nn.Linear(4, 1)
    return model


def _describe(model: Any, **kwargs: Any) -> ModelDescription:
    parts: dict[str, Any] = {"before": (model.embed,), "blocks": model.layers,
                             "after": (model.head,)}
    parts.update(kwargs)
    return ModelDescription(model=model, loss=nn.functional.mse_loss,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **parts)


def test_a_description_names_its_parts_as_the_model_does() -> None:
    described = _describe(_model())
    assert described.names == {"before[0]": "embed", "blocks": "layers", "after[0]": "head"}
    assert described.block_name(2) == "layers.2"
    assert described.block_sizes() == [20, 20, 20] and described.outer_sizes() == (12, 5)


@pytest.mark.parametrize("change, words", [
    (lambda m: {"after": ()}, "'head.weight' is in none of"),
    (lambda m: {"before": (nn.Linear(2, 2),)}, "not a submodule of model"),
    (lambda m: {"blocks": nn.ModuleList()}, "non-empty nn.ModuleList"),
    (lambda m: {"after": (m.head, m.layers[0])}, "in both"),
    (lambda m: {"block_tp_plan": {"up": ColwiseParallel()}}, "'up', which block 0 lacks"),
    (lambda m: {"outer_tp_plan": {"layers.0": ColwiseParallel()}},
     "'layers.0', which is no module of before= or after="),
    (lambda m: {"outer_tp_plan": {"head.nothing": ColwiseParallel()}}, "'head.nothing', which"),
])
def test_a_bad_description_is_one_config_error_line(change: Any, words: str) -> None:
    model = _model()
    with pytest.raises(ConfigError) as caught:
        _describe(model, **change(model))
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_stage_keeps_the_whole_models_names_and_applies_its_parts_in_order() -> None:
    described = dm.describe()
    model: Any = described.model
    blocks = [(f"layers.{i}", block) for i, block in enumerate(model.layers)]
    stage = StageModule([("embed", model.embed), *blocks[:2]])
    assert set(dict(stage.named_parameters())) == {
        name for name, _ in model.named_parameters()
        if name.startswith(("embed.", "layers.0.", "layers.1."))}
    whole = StageModule([("embed", model.embed), *blocks, ("norm", model.norm),
                         ("head", model.head)])
    x = dm.Sequences(3)[0][0][None]
    torch.testing.assert_close(whole(x), model(x))


@pytest.mark.parametrize("kwargs, words", [
    ({"schedule": "Zigzag"}, "is not supported"),
    ({"schedule": "1F1B", "stages_per_rank": 2}, "with stages_per_rank=2"),
    ({"schedule": "Interleaved1F1B"}, "with stages_per_rank=1"),
    ({"n_microbatches": 0}, "count below 1"),
])
def test_bad_schedule_options_are_one_config_error_line(kwargs: dict[str, object],
                                                        words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ModelParallel(**kwargs)  # type: ignore[arg-type]
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("options, loop_count, samples, pp, want", [
    ({"schedule": "GPipe"}, 1, 8, 2, 2),      # one per stage
    ({"schedule": "GPipe"}, 4, 8, 2, 4),      # the loop's micro-batches
    ({"schedule": "GPipe", "n_microbatches": 3}, 1, 8, 2, 2),  # equal sizes: 3 -> 2
    ({"schedule": "1F1B"}, 1, 8, 3, 4),       # >= pp stages, dividing 8
    ({"schedule": "GPipe"}, 1, 1, 2, 1),
])
def test_microbatches_cut_a_share_evenly_into_a_count_the_schedule_accepts(
        options: dict[str, object], loop_count: int, samples: int, pp: int, want: int) -> None:
    mp = ModelParallel(**options)  # type: ignore[arg-type]
    assert mp.microbatches(loop_count=loop_count, samples=samples, stages=pp, pp=pp) == want


def test_a_share_too_small_for_1f1b_is_one_config_error_line() -> None:
    with pytest.raises(ConfigError, match="cannot be cut"):
        ModelParallel(schedule="1F1B").microbatches(loop_count=1, samples=1, stages=2, pp=2)


def test_sources_are_one_clean_holder_per_part_of_one_cut_at_the_newest_step() -> None:
    holders = [Holder(5, 5, (0, 0), (2, 1)), Holder(5, 5, (0, 0), (2, 1)),
               Holder(-1, 5, (1, 0), (2, 1)), Holder(4, 4, (1, 0), (2, 1))]
    none: list[list[Copy]] = [[] for _ in holders]
    assert pick_sources(holders, none) is None  # step 5 lacks stage 1; step 4 lacks stage 0
    holders[2] = Holder(5, 5, (1, 0), (2, 1))
    assert pick_sources(holders, none) == Choice(5, {(0, 0): 0, (1, 0): 2},
                                                 frozenset({(0, 0), (1, 0)}))
    assert pick_sources([Holder(-1, -1, None, None)] * 2, [[], []]) is None


def test_a_cut_tensor_needs_every_piece_and_a_whole_one_its_lowest_holder() -> None:
    whole = Entry((4, 2), torch.float32)
    half, other = (Entry((4, 2), torch.float32, 0, i, 2) for i in range(2))
    assert pieces_of("w", {3: {"w": whole}, 1: {"w": whole}}) == [(1, whole)]
    assert pieces_of("w", {2: {"w": other}, 0: {"w": half}}) == [(0, half), (2, other)]
    with pytest.raises(ElasticError, match="pieces"):
        pieces_of("w", {0: {"w": half}})
    with pytest.raises(ElasticError, match="no source"):
        pieces_of("v", {0: {"w": half}})


def test_fsdp_pieces_of_tensor_parallel_pieces_are_boxes_and_replicas_give_one() -> None:
    # fsdp2 x tp2 of a (8, 4) column-parallel weight: tp cuts rows 0-3 | 4-7, fsdp each in two
    boxes = [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 4)), ((6, 8), (0, 4))]
    pieces = [Entry((8, 4), torch.float32, held=box) for box in boxes]
    # HSDP: ranks 4-7 hold the same boxes as ranks 0-3; the lowest holder of each is read
    held = {rank: {"w": pieces[rank % 4]} for rank in (7, 2, 5, 0, 1, 3, 4, 6)}
    assert pieces_of("w", held) == [(rank, pieces[rank]) for rank in range(4)]
    with pytest.raises(ElasticError, match="do not cover"):
        pieces_of("w", {0: {"w": pieces[0]}, 4: {"w": pieces[0]}, 2: {"w": pieces[2]}})
    # a held box is moved like a tp piece: a row-parallel receiver takes its columns of it
    target = Entry((8, 4), torch.float32, 1, 1, 2)
    assert overlap(pieces[1].box(), target.box()) == ((2, 4), (2, 4))


def test_each_receiver_gets_exactly_the_part_of_each_piece_it_holds() -> None:
    rows = [Entry((5, 4), torch.float32, 0, i, 2) for i in range(2)]  # rows 0-2, 3-4
    cols = [Entry((5, 4), torch.float32, 1, i, 2) for i in range(2)]  # columns 0-1, 2-3
    whole = Entry((5, 4), torch.float32)
    sources: dict[int, dict[str, Any]] = {0: {"w": rows[0], "lr": 0.1}, 1: {"w": rows[1]}}
    plan = plan_moves(sources, [{"w": cols[0]}, {"w": cols[1]}, {"w": whole}, {"lr": 0.1}])
    assert plan == {
        (0, 0): [("w", rows[0], ((0, 3), (0, 2)))], (0, 1): [("w", rows[1], ((3, 5), (0, 2)))],
        (1, 0): [("w", rows[0], ((0, 3), (2, 4)))], (1, 1): [("w", rows[1], ((3, 5), (2, 4)))],
        (2, 0): [("w", rows[0], ((0, 3), (0, 4)))], (2, 1): [("w", rows[1], ((3, 5), (0, 4)))],
    }
    assert overlap(rows[0].box(), Entry((5, 4), torch.float32, 0, 1, 2).box()) is None
    assert overlap((), ()) == ()  # a scalar (Adam's step) always moves whole


def test_model_parallel_picks_the_runtime_parallel_family() -> None:
    from elastic_rt.worker.trainers import StepOptions, choose
    from elastic_rt.worker.trainers.runtime_parallel.trainer import RuntimeParallelTrainer

    options = StepOptions(autocast_dtype=torch.bfloat16, accumulates=True, clip_grad_norm=1.0)
    trainer = choose(build=lambda layout: None, step=None, limits=ModelLimits(),
                     options=options, peer_copy_every=1, model_parallel=ModelParallel())
    assert isinstance(trainer, RuntimeParallelTrainer)
    assert (trainer.autocast_dtype, trainer.accumulates, trainer.clip_grad_norm) == (
        torch.bfloat16, True, 1.0)


@pytest.mark.parametrize("kwargs, words", [
    ({"is_step_owned": False}, "step is set with model_parallel"),
    ({"autocast_dtype": torch.float16}, "float16 with model_parallel"),
])
def test_run_options_refuse_what_the_family_cannot_train(kwargs: dict[str, Any],
                                                         words: str) -> None:
    from elastic_rt.worker.run_options import RunOptions

    options = {"global_batch_size": 8, "max_steps": 1, "is_step_owned": True,
               "is_runtime_parallel": True, **kwargs}
    with pytest.raises(ConfigError, match=words):
        RunOptions(**options)
    RunOptions(global_batch_size=8, max_steps=1, is_step_owned=True, is_runtime_parallel=True,
               micro_batch_size=2)  # micro-batches are the pipeline's
    RunOptions(global_batch_size=8, max_steps=1, is_step_owned=True, is_runtime_parallel=True,
               limits=ModelLimits(max_pp=2, max_shard=4),  # FSDP over dp, with pp and tp
               clip_grad_norm=1.0, autocast_dtype=torch.bfloat16)


def test_each_fsdp_piece_of_a_part_needs_a_holder_and_hsdp_replicas_give_one() -> None:
    from elastic_rt.layout import Layout
    from elastic_rt.worker.trainers.runtime_parallel.sharding import holder_of

    hsdp = Layout(dp=4, tp=2, shard=2)  # rank = dp * 2 + tp; pieces: dp % 2
    holders = [holder_of(step=5, is_clean=True, layout=hsdp, rank=r) for r in range(8)]
    assert {h.cut for h in holders} == {(1, 4)}
    none: list[list[Copy]] = [[] for _ in holders]
    found = pick_sources(holders, none)
    assert found is not None
    assert (found.step, found.ranks) == (5, {(0, 0): 0, (0, 1): 1, (0, 2): 2, (0, 3): 3})
    # ranks 2 and 6 hold the same piece (dp 1 and 3, tp 0): losing both loses it
    lost = [h if r not in (2, 6) else holder_of(step=-1, is_clean=False, layout=None, rank=None)
            for r, h in enumerate(holders)]
    assert pick_sources(lost, none) is None
    unsharded = holder_of(step=5, is_clean=True, layout=Layout(dp=2, tp=2), rank=3)
    assert (unsharded.part, unsharded.cut) == ((0, 1), (1, 2))
