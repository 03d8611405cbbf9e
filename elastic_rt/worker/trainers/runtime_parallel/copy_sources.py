"""Which ranks a runtime-parallel round restores from when live parts and peer copies count.

Rule: the newest step at which every ``(pp, tp)`` part of one cut has a source wins; a part's
source is, in this order, the lowest rank holding it live (it finished that step and did not
start the next) and the lowest rank holding a completed snapshot of it at that step (its own
part's, or a copy it holds for a rank on another node, ``copies``). Live state and a
snapshot of one step are the same bytes, so one cut may mix them: after a node loss the
survivors give their own parts, and the lost parts come from the copies their holders
keep. With no copies this is the survivors' choice alone. None: no step is covered, and the
caller falls back to the checkpoint.

:func:`pick_sources` and :func:`needs_copies` are pure; :func:`gather` is the one collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.model_parallel.part_broadcast import Holder, Part


@dataclass(frozen=True, slots=True)
class Copy:
    """One part of a completed snapshot a rank holds: at ``step``, of the cut ``cut``."""

    step: int
    cut: Part
    part: Part


@dataclass(frozen=True, slots=True)
class Choice:
    """Where each part of the chosen step's cut comes from."""

    step: int
    ranks: dict[Part, int]
    """Each part's source rank."""
    live: frozenset[Part]
    """The parts whose source gives its live state; the others come from a snapshot."""


def pick_sources(holders: list[Holder], copies: list[list[Copy]], *,
                 newest: int | None = None) -> Choice | None:
    """The newest step whose cut is covered by live parts and snapshots, per part the
    preferred source (live first, then the lowest rank); None when no step is covered.

    ``holders[r]`` and ``copies[r]`` are rank ``r``'s live part and its snapshots' parts;
    steps after ``newest`` (the last step any rank committed) are passed over.
    """
    offered = [(h.step, h.cut) for h in holders if h.step >= 0 and h.cut is not None]
    offered += [(c.step, c.cut) for held in copies for c in held]
    if newest is not None:
        offered = [(step, cut) for step, cut in offered if step <= newest]
    for step, cut in sorted(set(offered), key=lambda sc: (-sc[0], sc[1])):
        live = {h.part: r for r, h in reversed(list(enumerate(holders)))
                if h.step == step and h.cut == cut and h.part is not None}
        copied = {c.part: r for r, held in reversed(list(enumerate(copies))) for c in held
                  if c.step == step and c.cut == cut}
        ranks = {**copied, **live}
        if len(ranks) == cut[0] * cut[1]:
            return Choice(step, ranks, frozenset(live))
    return None


def needs_copies(layout: Layout, nodes: list[str]) -> bool:
    """Whether one node's loss can take every holder of a part (no replica on another node):
    then each rank's part is copied to another node. ``nodes[r]`` is rank ``r``'s.
    Sharded, a part is one piece: its holders are the same piece in each replica."""
    holders = ([[layout.rank_of(pp, dp, tp) for dp in range(layout.dp)]
                for pp in range(layout.pp) for tp in range(layout.tp)]
               if layout.shard == 1 else layout.replicate_groups())
    return any(len({nodes[rank] for rank in ranks}) == 1 for ranks in holders)


def gather(mine: Holder, copies: list[Copy],
           group: dist.ProcessGroup) -> tuple[list[Holder], list[list[Copy]]]:
    """Every rank's live :class:`Holder` and snapshot parts, indexed by rank. Collective."""
    entries: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, (mine, copies), group=group)
    return [holder for holder, _ in entries], [held for _, held in entries]
