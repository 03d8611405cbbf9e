"""Unit tests for the pure part of piece_sync: which ranks restore a sharded state."""

from __future__ import annotations

from elastic_rt.worker.piece_sync import Holding, Sources, pick_piece_sources


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
