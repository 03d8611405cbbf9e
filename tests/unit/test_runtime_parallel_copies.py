"""The runtime-parallel family's choice of sources when peer copies count, and where copies
are kept: pure parts of ``copy_sources``."""

from __future__ import annotations

import pytest

from elastic_rt.errors import ConfigError
from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.model_parallel.part_broadcast import Holder
from elastic_rt.worker.trainers.runtime_parallel.copies import PartCopies
from elastic_rt.worker.trainers.runtime_parallel.copy_sources import (
    Choice,
    Copy,
    needs_copies,
    pick_sources,
)

PP2 = (2, 1)
NOBODY = Holder(-1, -1, None, None)


def _live(step: int, pp: int) -> Holder:
    return Holder(step, step, (pp, 0), PP2)


def test_live_parts_that_cover_the_cut_are_the_sources_and_copies_are_not_read() -> None:
    holders = [_live(5, 0), _live(5, 1)]
    copies = [[Copy(5, PP2, (0, 0)), Copy(5, PP2, (1, 0))], []]
    assert pick_sources(holders, copies) == Choice(5, {(0, 0): 0, (1, 0): 1},
                                                   frozenset({(0, 0), (1, 0)}))


def test_a_lost_stage_comes_from_its_ring_holders_copy_beside_the_live_stage() -> None:
    # pp2 on two nodes; node 1 died after step 5; a newcomer took rank 1, holding nothing
    holders = [_live(5, 0), NOBODY]
    copies = [[Copy(5, PP2, (0, 0)), Copy(5, PP2, (1, 0))], []]
    assert pick_sources(holders, copies) == Choice(5, {(0, 0): 0, (1, 0): 0},
                                                   frozenset({(0, 0)}))


def test_copies_older_than_the_live_state_roll_every_part_back_to_their_step() -> None:
    # copies every 2 steps: the newest snapshot is of step 4, the survivor lives at 5
    holders = [_live(5, 0), NOBODY]
    copies = [[Copy(2, PP2, (0, 0)), Copy(2, PP2, (1, 0)),
               Copy(4, PP2, (0, 0)), Copy(4, PP2, (1, 0))], []]
    assert pick_sources(holders, copies) == Choice(4, {(0, 0): 0, (1, 0): 0}, frozenset())


def test_snapshots_of_a_step_nobody_committed_are_passed_over() -> None:
    # rank 0 finished step 6's update and snapshot, then failed waiting for the copies (its
    # live state is not clean); the lost rank's copy of 6 had landed, yet nobody committed
    # 6: the round resumes after step 5, the newest step that counted
    holders = [Holder(-1, 5, (0, 0), PP2), NOBODY]
    copies = [[Copy(5, PP2, (0, 0)), Copy(6, PP2, (0, 0)),
               Copy(5, PP2, (1, 0)), Copy(6, PP2, (1, 0))], []]
    assert pick_sources(holders, copies, newest=5) == Choice(5, {(0, 0): 0, (1, 0): 0},
                                                             frozenset())
    unbounded = pick_sources(holders, copies)
    assert unbounded is not None and unbounded.step == 6


def test_the_lowest_rank_gives_a_part_and_a_part_and_its_copy_lost_together_is_none() -> None:
    cut = (4, 1)
    holders = [Holder(3, 3, (pp, 0), cut) for pp in range(4)]
    holders[1] = holders[2] = NOBODY  # a node of ranks 1-2 lost: stage 1's copy was on 2
    copies = [[Copy(3, cut, (0, 0)), Copy(3, cut, (3, 0))], [], [],
              [Copy(3, cut, (3, 0)), Copy(3, cut, (2, 0))]]
    assert pick_sources(holders, copies) is None
    copies[0].append(Copy(3, cut, (1, 0)))
    got = pick_sources(holders, copies)
    assert got == Choice(3, {(0, 0): 0, (1, 0): 0, (2, 0): 3, (3, 0): 3},
                         frozenset({(0, 0), (3, 0)}))


def test_snapshots_of_another_cut_are_never_mixed_into_a_cut() -> None:
    holders = [_live(5, 0), NOBODY]
    copies = [[Copy(5, (1, 2), (0, 1))], []]  # a tp part of another round's cut
    assert pick_sources(holders, copies) is None
    assert pick_sources([NOBODY, NOBODY], [[], []]) is None


@pytest.mark.parametrize("layout, nodes, want", [
    (Layout(dp=1, pp=2), "ab", True),        # each stage on one node only
    (Layout(dp=2, pp=2), "abcd", False),     # a replica of each stage on another node
    (Layout(dp=2, pp=2), "aabb", True),      # both replicas of a stage on one node
    (Layout(dp=2, pp=2), "aaab", True),      # stage 0's replicas both on a
    (Layout(dp=1, tp=2), "ab", True),
    (Layout(dp=4), "aabb", False),
])
def test_copies_are_kept_where_one_node_holds_every_holder_of_a_part(
        layout: Layout, nodes: str, want: bool) -> None:
    assert needs_copies(layout, list(nodes)) is want


def test_a_negative_copy_interval_is_one_config_error_line() -> None:
    with pytest.raises(ConfigError, match="peer_copy_every=-1"):
        PartCopies(-1)


@pytest.mark.parametrize("layout, survives", [
    (Layout(dp=2, pp=2), True), (Layout(dp=2, tp=2), True),
    (Layout(dp=2, tp=2, shard=2), False), (Layout(dp=2, pp=2, shard=2), False),
], ids=["pp2xdp2", "tp2xdp2", "fsdp2xtp2", "pp2xfsdp2"])
def test_losing_any_one_rank_leaves_a_whole_cut_where_each_part_has_a_replica(
        layout: Layout, survives: bool) -> None:
    # An FSDP piece (shard = dp here) has one holder: without copies it goes with its
    # rank; with the snapshots of step 1 each rank keeps (its own piece, its ring
    # neighbour's), the survivors cover the cut at step 1 (one step done again).
    from elastic_rt.worker.trainers.runtime_parallel.sharding import holder_of, piece_of

    for lost in range(4):
        holders = [NOBODY if r == lost else holder_of(step=2, is_clean=True, layout=layout, rank=r)
                   for r in range(4)]
        choice = pick_sources(holders, [[] for _ in range(4)])
        assert (choice is not None) == survives, lost
        if choice is not None:
            assert choice.step == 2 and lost not in choice.ranks.values()
        copies = [[] if r == lost else [Copy(1, *piece_of(layout, r)),  # its own snapshot
                                        Copy(1, *piece_of(layout, (r - 1) % 4))]
                  for r in range(4)]
        choice = pick_sources(holders, copies)
        assert choice is not None and lost not in choice.ranks.values()
        assert choice.step == (2 if survives else 1), lost
