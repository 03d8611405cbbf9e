"""Which survivors can restore a model-parallel round's parts (pure decision)."""

from __future__ import annotations

from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.model_parallel.part_broadcast import Holder, pick_part_sources

PP2 = Layout(dp=1, pp=2)
DP2_PP2 = Layout(dp=2, pp=2)
NEW = Holder.of(step=-1, is_clean=True, layout=None, rank=None)


def _held(step: int, layout: Layout, rank: int, is_clean: bool = True) -> Holder:
    return Holder.of(step=step, is_clean=is_clean, layout=layout, rank=rank)


def test_growth_with_the_same_cut_takes_each_stage_from_its_survivor() -> None:
    # pp2 on two ranks grows to dp2 x pp2: the old ranks 0 and 1 held stages 0 and 1.
    holders = [_held(7, PP2, 0), _held(7, PP2, 1), NEW, NEW]
    assert pick_part_sources(holders, DP2_PP2) == (7, {(0, 0): 0, (1, 0): 1})


def test_a_lost_stage_with_no_replica_gives_no_sources() -> None:
    # dp2 x pp2, the node holding both replicas of stage 1 is gone; the survivors held stage 0.
    holders = [_held(12, DP2_PP2, 0), _held(12, DP2_PP2, 1)]
    assert pick_part_sources(holders, PP2) is None


def test_a_rank_whose_step_raised_is_not_a_source() -> None:
    holders = [_held(7, PP2, 0), _held(7, PP2, 1, is_clean=False)]
    assert pick_part_sources(holders, PP2) is None
    assert holders[1].last_step == 7


def test_the_highest_step_every_part_has_wins() -> None:
    # Stage 0 has replicas at steps 8 and 7, stage 1 only at 7: all must restore step 7.
    holders = [_held(8, DP2_PP2, 0), _held(7, DP2_PP2, 1), _held(7, DP2_PP2, 2), NEW]
    assert pick_part_sources(holders, DP2_PP2) == (7, {(0, 0): 1, (1, 0): 2})


def test_a_new_cut_needs_the_checkpoint() -> None:
    holders = [_held(5, Layout(dp=1, pp=3), r) for r in range(3)] + [NEW]
    assert pick_part_sources(holders, DP2_PP2) is None


def test_tensor_parallel_parts_come_from_the_checkpoint() -> None:
    tp2 = Layout(dp=1, tp=2)
    assert pick_part_sources([_held(3, tp2, 0), _held(3, tp2, 1)], tp2) is None


def test_a_fresh_start_has_no_sources_and_no_state() -> None:
    holders = [NEW, NEW]
    assert pick_part_sources(holders, PP2) is None
    assert max(h.last_step for h in holders) == -1
