"""Restore model-parallel state after a re-form: from surviving shard replicas when they cover it.

A script whose ``build(layout)`` returns an object that owns its step (a pipeline stage, a
tensor shard) holds only part of the model on each rank. After a re-form every rank rebuilds
its object for the new layout (the old one is bound to destroyed process groups), and needs
the state of its new shard. That state can come from surviving ranks only when

* the new layout cuts the model the same way (same ``pp`` and ``tp``), and
* every shard has a survivor that holds it *cleanly* at one common step: it finished that step
  and did not start the next. A rank whose step raised may have applied its optimizer update
  before a later collective failed, so its state is not trusted.

Otherwise the caller falls back to the last committed checkpoint, resharded (DCP).

:func:`pick_shard_sources` is the pure decision; :func:`gather_holders` and
:func:`broadcast_shards` are the thin collective parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state

logger = logging.getLogger(__name__)

Shard = tuple[int, int]
"""A shard of the model: its ``(pp, tp)`` coordinates."""


@dataclass(frozen=True, slots=True)
class Holder:
    """What one rank of the new round holds from its previous round.

    Attributes:
        step: the step its state is cleanly at, or -1 (nothing, or a step that raised).
        last_step: the last step it committed, -1 if it never held state; tells a fresh
            start (nobody held anything) from lost state, and how much work a rollback loses.
        shard: the ``(pp, tp)`` shard it held, or None.
        cut: the ``(pp, tp)`` degrees of the layout it held the shard under, or None.
    """

    step: int
    last_step: int
    shard: Shard | None
    cut: Shard | None

    @classmethod
    def of(cls, *, step: int, is_clean: bool, layout: Layout | None, rank: int | None) -> Holder:
        """This rank's entry; ``layout`` and ``rank`` are those of its previous round."""
        if layout is None or rank is None or step < 0:
            return cls(-1, step, None, None)
        coords = layout.coords(rank)
        return cls(step if is_clean else -1, step, (coords.pp, coords.tp), (layout.pp, layout.tp))


def pick_shard_sources(holders: list[Holder],
                       layout: Layout) -> tuple[int, dict[Shard, int]] | None:
    """The step and, per shard of ``layout``, the lowest rank holding it cleanly at that step.

    The highest step at which every shard has a clean holder wins. None when there is no
    such step, the cut changed, or ``layout.tp > 1``.

    Note:
        Tensor-parallel shards are DTensors bound to their round's mesh, which is destroyed
        by the time we restore; they come back through the checkpoint instead.
    """
    if layout.tp > 1:
        return None
    cut = (layout.pp, layout.tp)
    needed = [(pp, tp) for pp in range(layout.pp) for tp in range(layout.tp)]
    for step in sorted({h.step for h in holders if h.step >= 0 and h.cut == cut}, reverse=True):
        sources: dict[Shard, int] = {}
        for rank, holder in enumerate(holders):
            if holder.step == step and holder.cut == cut and holder.shard is not None:
                sources.setdefault(holder.shard, rank)
        if all(shard in sources for shard in needed):
            return step, sources
    return None


def gather_holders(mine: Holder, group: dist.ProcessGroup) -> list[Holder]:
    """Every rank's :class:`Holder`, indexed by rank in ``group``. Collective."""
    entries: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, (mine.step, mine.last_step, mine.shard, mine.cut), group=group)
    return [Holder(step, last, _shard(shard), _shard(cut)) for step, last, shard, cut in entries]


def broadcast_shards(read: Callable[[], Any], sources: dict[Shard, int], mine: Shard,
                     group: dist.ProcessGroup) -> Any:
    """Send each shard's state from its source; return the one for shard ``mine``. Collective.

    ``read()`` is called only on source ranks, for the state they hold. Every shard goes to
    the whole group (one flat broadcast per dtype each): simple, and shards are sent once.
    """
    rank = dist.get_rank(group)
    received = None
    for shard, src in sorted(sources.items()):
        state = broadcast_state(read() if rank == src else None, src, group)
        if shard == mine:
            received = state
    return received


def _shard(value: Any) -> Shard | None:
    return None if value is None else (int(value[0]), int(value[1]))
