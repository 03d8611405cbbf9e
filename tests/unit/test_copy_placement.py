"""Where peer copies are kept (``copy_placement``): always on another node, spread evenly,
the ring back on equal nodes; and on nodes of unequal sizes a whole cut survives the loss
of either node."""

from __future__ import annotations

from collections import Counter

import pytest

from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.copy_placement import copy_holders, held_for
from elastic_rt.worker.trainers.model_parallel.part_broadcast import Holder
from elastic_rt.worker.trainers.runtime_parallel.copy_sources import Copy, pick_sources
from elastic_rt.worker.trainers.runtime_parallel.sharding import holder_of, piece_of

NOBODY = Holder(-1, -1, None, None)


@pytest.mark.parametrize("nodes, holders", [
    ("ab", [1, 0]),
    ("aabb", [2, 3, 0, 1]),            # the same local rank on the next node
    ("aaabbbccc", [3, 4, 5, 6, 7, 8, 0, 1, 2]),
    ("abab", [1, 2, 3, 0]),
    ("aaab", [3, 3, 3, 0]),            # the lone rank holds the three others' copies
    ("aabbb", [2, 3, 0, 1, 0]),
])
def test_each_copy_is_on_another_node_and_equal_nodes_get_the_ring(
        nodes: str, holders: list[int]) -> None:
    assert copy_holders(list(nodes)) == holders


@pytest.mark.parametrize("nodes", ["aaab", "abbb", "aabbb", "aaaabbc", "abcccc", "aabbccc"])
def test_copies_spread_over_the_ranks_that_can_hold_them(nodes: str) -> None:
    holders = copy_holders(list(nodes))
    assert holders is not None
    assert all(nodes[rank] != nodes[holder] for rank, holder in enumerate(holders))
    # no rank holds more than it must: the largest node's ranks need somewhere to go
    largest = max(Counter(nodes).values())
    others = len(nodes) - largest
    assert max(Counter(holders).values()) <= -(-largest // others)
    for rank in range(len(nodes)):
        assert all(holders[source] == rank for source in held_for(rank, holders))
    assert sorted(s for r in range(len(nodes)) for s in held_for(r, holders)) == \
        list(range(len(nodes)))


def test_one_node_keeps_no_copies() -> None:
    assert copy_holders(["a", "a", "a"]) is None
    assert copy_holders(["a"]) is None


@pytest.mark.parametrize("layout", [Layout(dp=2, pp=2, shard=2), Layout(dp=2, tp=2, shard=2),
                                    Layout(dp=1, pp=4), Layout(dp=1, pp=2, tp=2)],
                         ids=["pp2xfsdp2", "fsdp2xtp2", "pp4", "pp2xtp2"])
@pytest.mark.parametrize("nodes", ["aaab", "abbb"])
def test_on_nodes_of_three_and_one_either_nodes_loss_leaves_a_whole_cut(
        layout: Layout, nodes: str) -> None:
    # Each rank snapshots its own part at step 1 and holds the copies placed on it; a node
    # is lost after step 2: the survivors' live parts and the copies cover step 1.
    holders = copy_holders(list(nodes))
    assert holders is not None
    for lost in set(nodes):
        live = [NOBODY if nodes[r] == lost
                else holder_of(step=2, is_clean=True, layout=layout, rank=r) for r in range(4)]
        copies = [[] if nodes[r] == lost else
                  [Copy(1, *piece_of(layout, source)) for source in (r, *held_for(r, holders))]
                  for r in range(4)]
        assert pick_sources(live, [[] for _ in range(4)]) is None, lost  # no replica
        choice = pick_sources(live, copies)
        assert choice is not None and choice.step == 1, lost
        assert not {r for r in range(4) if nodes[r] == lost} & set(choice.ranks.values())
