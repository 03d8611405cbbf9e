"""Unit tests for the pure parts of row_fetch: which ranks restore a sharded state, and
which old pieces hold the rows a new piece needs."""

from __future__ import annotations

import pytest
import torch

from elastic_rt.worker.trainers.sharded.row_fetch import (
    Holding,
    Sources,
    chunk_rows,
    pick_piece_sources,
    row_sources,
)


def test_every_piece_of_the_newest_step_is_taken_from_its_lowest_holder() -> None:
    # hsdp2x2 lost ranks 0 and 3: piece 0 survives on rank 2 (old 2), piece 1 on rank 1.
    holdings = [[], [Holding(7, 2, 1)], [Holding(7, 2, 0)], []]
    assert pick_piece_sources(holdings) == Sources(7, (2, 1))


def test_a_missing_piece_falls_back_to_an_older_step_that_is_whole() -> None:
    # Live pieces at step 9 lack piece 2; copies of step 8 cover all three.
    holdings = [[Holding(9, 3, 0), Holding(8, 3, 1)], [Holding(9, 3, 1), Holding(8, 3, 2)],
                [Holding(8, 3, 0)]]
    assert pick_piece_sources(holdings) == Sources(8, (2, 0, 1))


def test_no_step_with_every_piece_means_no_sources() -> None:
    assert pick_piece_sources([[Holding(5, 3, 0)], [Holding(5, 3, 2)], []]) is None
    assert pick_piece_sources([[], []]) is None


def test_pieces_of_different_cuts_are_never_mixed() -> None:
    holdings = [[Holding(4, 2, 0)], [Holding(4, 3, 1)], [Holding(4, 3, 2)]]
    assert pick_piece_sources(holdings) is None


def _reports(*, nodes: int, per_node: int, lost: set[int], live: int,
             copied: dict[int, list[int]]) -> list[list[Holding]]:
    """What the surviving ranks of an FSDP job report after losing the nodes in ``lost``.

    Rank ``r`` holds piece ``r`` live at step ``live``, and its *completed* snapshots (the
    newest, and the one before until the next refresh reuses its buffer): its own piece and
    the copy of rank ``r - per_node``'s (its ring neighbour on the previous node) at each step
    of ``copied[r]``. Survivors are renumbered in order, as in the new round.
    """
    count = nodes * per_node
    reports = []
    for rank in range(count):
        if rank // per_node in lost:
            continue
        held = [Holding(live, count, rank)]
        for step in copied.get(rank, []):
            held += [Holding(step, count, rank), Holding(step, count, (rank - per_node) % count)]
        reports.append(held)
    return reports


def test_fsdp_restores_a_lost_node_from_the_copies_its_ring_neighbours_hold() -> None:
    # fsdp4 on two nodes of two; node 1 (ranks 2, 3) is lost during step 10, after the
    # copies of step 9 arrived: pieces 2 and 3 come from ranks 0 and 1's copies.
    reports = _reports(nodes=2, per_node=2, lost={1}, live=9, copied={0: [8, 9], 1: [8, 9]})
    assert pick_piece_sources(reports) == Sources(9, (0, 1, 0, 1))


def test_a_copy_still_in_flight_does_not_count_the_previous_one_does() -> None:
    # The copies of step 9 had not arrived when node 1 was lost: both survivors report step
    # 8 as their newest snapshot, so step 8 is restored and step 9 is done again.
    reports = _reports(nodes=2, per_node=2, lost={1}, live=9, copied={0: [7, 8], 1: [7, 8]})
    assert pick_piece_sources(reports) == Sources(8, (0, 1, 0, 1))


def test_copies_that_arrived_on_some_ranks_only_fall_back_to_the_step_before() -> None:
    # Rank 0 has step 9's copy, rank 1 only step 8's: rank 0 still keeps step 8's (its buffer
    # is reused by the next refresh only), so step 8 is whole.
    reports = _reports(nodes=2, per_node=2, lost={1}, live=9, copied={0: [8, 9], 1: [7, 8]})
    assert pick_piece_sources(reports) == Sources(8, (0, 1, 0, 1))
    # Had rank 0 begun the next refresh (dropping step 8's) while rank 1's copy of step 9 was
    # still late, neither step is whole: the caller loads the checkpoint (steps redone, none
    # lost or skipped).
    reports = _reports(nodes=2, per_node=2, lost={1}, live=10, copied={0: [9], 1: [7, 8]})
    assert pick_piece_sources(reports) is None


def test_losing_a_node_and_the_holder_of_its_copies_leaves_no_whole_step() -> None:
    # fsdp6 on three nodes of two, copies on: nodes 1 and 2 are lost at once. Node 0 holds
    # its own pieces 0, 1 and the copies of node 2's pieces 4, 5; node 1's pieces 2, 3 were
    # copied to node 2 only. Whatever the steps, no sharding is whole: the checkpoint.
    reports = _reports(nodes=3, per_node=2, lost={1, 2}, live=9, copied={0: [8, 9], 1: [8, 9]})
    assert [sorted({h.index for h in held}) for held in reports] == [[0, 4], [1, 5]]
    assert pick_piece_sources(reports) is None
    # One node of three lost: the copies on the next node (ranks 2, 3 now) cover it; the
    # lowest holder of each piece is its source (pieces 4, 5: node 0's copies).
    reports = _reports(nodes=3, per_node=2, lost={1}, live=9,
                       copied={r: [8, 9] for r in range(6)})
    assert pick_piece_sources(reports) == Sources(9, (0, 1, 2, 3, 0, 1))


@pytest.mark.parametrize("total", [0, 1, 5, 10, 17])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 6])
def test_rows_are_cut_as_torch_chunk_cuts_them_and_found_again_among_old_pieces(
        total: int, count: int) -> None:
    rows = torch.arange(total)
    chunks = list(torch.chunk(rows, count)) if total else []
    chunks += [rows[:0]] * (count - len(chunks))  # FSDP2 gives trailing ranks empty pieces
    for index in range(count):
        start, stop = chunk_rows(total, count, index)
        assert torch.equal(rows[start:stop], chunks[index])
        for old_count in (1, 2, 3, 4):
            old = list(torch.chunk(rows, old_count)) if total else []
            found = [old[piece][lo:hi] for piece, lo, hi
                     in row_sources(total, old_count, start, stop)]
            assert torch.equal(torch.cat(found) if found else rows[:0], rows[start:stop])
