"""Restore a model-parallel round's parts from survivors, when they hold all of one cut.

A *part* is what one rank holds of a model cut by pipeline and tensor parallelism: its
``(pp, tp)`` coordinates. After a re-form every rank rebuilds its object for the new layout
(the old one is bound to destroyed process groups) and needs the state of its new part.
Survivors can give it only when

* the new layout cuts the model the same way (same ``pp`` and ``tp``), and
* every part has a survivor that holds it *cleanly* at one common step: it finished that step
  and did not start the next. A rank whose step raised may have applied its optimizer update
  before a later collective failed, so its state is not trusted.

The highest such step wins; otherwise the caller falls back to the last committed checkpoint,
loaded into the new cut (DCP). :func:`pick_part_sources` is the pure decision;
:func:`gather_holders` and :func:`broadcast_parts` are the thin collective parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state

logger = logging.getLogger(__name__)

Part = tuple[int, int]
"""A part of the model: its ``(pp, tp)`` coordinates."""


@dataclass(frozen=True, slots=True)
class Holder:
    """What one rank of the new round holds from its previous round.

    Attributes:
        step: the step its state is cleanly at, or -1 (nothing, or a step that raised).
        last_step: the last step it committed, -1 if it never held state; tells a fresh
            start (nobody held anything) from lost state, and how much work a rollback loses.
        part: the ``(pp, tp)`` part it held, or None.
        cut: the ``(pp, tp)`` degrees of the layout it held the part under, or None.
    """

    step: int
    last_step: int
    part: Part | None
    cut: Part | None

    @classmethod
    def of(cls, *, step: int, is_clean: bool, layout: Layout | None, rank: int | None) -> Holder:
        """This rank's entry; ``layout`` and ``rank`` are those of its previous round."""
        if layout is None or rank is None or step < 0:
            return cls(-1, step, None, None)
        coords = layout.coords(rank)
        return cls(step if is_clean else -1, step, (coords.pp, coords.tp), (layout.pp, layout.tp))


def pick_part_sources(holders: list[Holder],
                      layout: Layout) -> tuple[int, dict[Part, int]] | None:
    """The step and, per part of ``layout``, the lowest rank holding it cleanly at that step.

    The highest step at which every part has a clean holder wins. None when there is no
    such step, the cut changed, or ``layout.tp > 1``.

    Note:
        Tensor-parallel parts are DTensors bound to their round's mesh, which is destroyed
        by the time we restore; they come back through the checkpoint instead.
    """
    if layout.tp > 1:
        return None
    cut = (layout.pp, layout.tp)
    needed = [(pp, tp) for pp in range(layout.pp) for tp in range(layout.tp)]
    for step in sorted({h.step for h in holders if h.step >= 0 and h.cut == cut}, reverse=True):
        sources: dict[Part, int] = {}
        for rank, holder in enumerate(holders):
            if holder.step == step and holder.cut == cut and holder.part is not None:
                sources.setdefault(holder.part, rank)
        if all(part in sources for part in needed):
            return step, sources
    return None


def gather_holders(mine: Holder, group: dist.ProcessGroup) -> list[Holder]:
    """Every rank's :class:`Holder`, indexed by rank in ``group``. Collective."""
    entries: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, (mine.step, mine.last_step, mine.part, mine.cut), group=group)
    return [Holder(step, last, _part(part), _part(cut)) for step, last, part, cut in entries]


def broadcast_parts(read: Callable[[], Any], sources: dict[Part, int], mine: Part,
                    group: dist.ProcessGroup) -> Any:
    """Send each part's state from its source; return the one for part ``mine``. Collective.

    ``read()`` is called only on source ranks, for the state they hold. Every part goes to
    the whole group (one flat broadcast per dtype each): simple, and parts are sent once.
    """
    rank = dist.get_rank(group)
    received = None
    for part, src in sorted(sources.items()):
        state = broadcast_state(read() if rank == src else None, src, group)
        if part == mine:
            received = state
    return received


def _part(value: Any) -> Part | None:
    return None if value is None else (int(value[0]), int(value[1]))
