"""Where each rank's peer copy is kept: on another node, spread over the ranks that can hold it.

A copy protects a piece only if it lives on another node than the piece. With equal nodes of
consecutive ranks the natural holder is the same local rank on the next node (a ring: each
rank holds one copy). Nodes of unequal sizes have no such ring (3 + 1 workers: the lone
rank is the only one off node ``a``), so the rule is a placement instead of a shift: each
rank picks the rank on another node that holds the fewest copies so far, the nearest one
after it on a tie; the ranks of larger nodes pick first, as they have the fewest places to
go. Equal nodes get the ring back; a small node's ranks hold several copies each (host
memory: two snapshots of their own piece and two of each copy held).

Both data-parallel sharding (``sharded``) and the runtime-parallel family use it; every rank
computes the same placement from the same gathered list of nodes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist


def copy_holders(nodes: list[str]) -> list[int] | None:
    """``holders[r]``: the rank that keeps rank ``r``'s copy (``nodes[r]`` is rank ``r``'s
    node). None when every rank is on one node: no copy would survive its loss."""
    world = len(nodes)
    if len(set(nodes)) < 2:
        return None
    size = Counter(nodes)
    load = [0] * world
    holders = [-1] * world
    for rank in sorted(range(world), key=lambda r: (-size[nodes[r]], r)):
        others = [(rank + k) % world for k in range(1, world)
                  if nodes[(rank + k) % world] != nodes[rank]]
        holder = min(others, key=lambda other: load[other])  # the nearest of the least loaded
        load[holder] += 1
        holders[rank] = holder
    return holders


def held_for(rank: int, holders: list[int]) -> tuple[int, ...]:
    """The ranks whose copies ``rank`` keeps, in rank order (none, one, or several)."""
    return tuple(source for source, holder in enumerate(holders) if holder == rank)


def gather_nodes(node: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's node, indexed by rank in ``group``. Collective."""
    nodes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, node, group=group)
    return [str(n) for n in nodes]
