"""Which survivors a runtime-parallel round restores from: one clean holder per part. Pure.

Rule: the highest step at which every ``(pp, tp)`` part of one cut has a holder that
finished that step and did not start the next wins; per part the lowest such rank is the
source. Unlike ``model_parallel.part_broadcast`` the new round may cut the model otherwise
(state moves by name, ``by_name``), and tensor-parallel parts count too (their DTensors'
local shards are read without their destroyed mesh).
"""

from __future__ import annotations

from elastic_rt.worker.trainers.model_parallel.part_broadcast import Holder, Part


def pick_cut_sources(holders: list[Holder]) -> tuple[int, dict[Part, int]] | None:
    """The step and, per part of the holders' cut, its source rank; None when no step is
    covered by one cut."""
    for step in sorted({h.step for h in holders if h.step >= 0}, reverse=True):
        for cut in sorted({h.cut for h in holders if h.step == step and h.cut is not None}):
            sources: dict[Part, int] = {}
            for rank, holder in enumerate(holders):
                if holder.step == step and holder.cut == cut and holder.part is not None:
                    sources.setdefault(holder.part, rank)
            if len(sources) == cut[0] * cut[1]:
                return step, sources
    return None
