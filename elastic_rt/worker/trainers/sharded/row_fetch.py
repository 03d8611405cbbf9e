"""Move FSDP rows: restore a sharded state after a re-form from the pieces that survived.

Rule: the highest step at which every piece of one sharding has a holder wins
(:func:`pick_piece_sources`); each rank then receives only its new rows (:func:`fetch_rows`).

Under FSDP every rank holds one piece (its rows) of the state; under HSDP each piece is held
once per replica group. After a node loss the survivors still hold their pieces of the last
step they finished, and ranks may hold copies of a neighbour's pieces (``peer_copies``). The
state can be rebuilt without storage when, for one step, every piece ``0..n-1`` of one
sharding ``n`` has a holder: the highest such step wins. Otherwise the caller falls back to
the last committed checkpoint, resharded.

Each rank of the new round receives only the rows its new piece holds, never the full state:
a rank of a 1,000-rank FSDP job would otherwise hold the whole model and optimizer for a
moment, and a restore after a node loss would move every byte to every rank.

:func:`pick_piece_sources` and :func:`row_sources` are the pure decisions;
:func:`gather_holdings` and :func:`fetch_rows` are the thin collective parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic_rt.errors import ElasticError
from elastic_rt.worker.trainers.sharded.fsdp import Piece, RowSpec
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state
from elastic_rt.worker.trainers.slice_exchange import exchange_slices


@dataclass(frozen=True, slots=True)
class Holding:
    """One piece of the state that a rank holds cleanly.

    Attributes:
        step: the step the piece is at.
        count: into how many pieces that state was cut (the old layout's ``shard``).
        index: which piece it is.
    """

    step: int
    count: int
    index: int


@dataclass(frozen=True, slots=True)
class Sources:
    """Where each piece of one step comes from: ``ranks[i]`` holds piece ``i``."""

    step: int
    ranks: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.ranks)


def pick_piece_sources(holdings: list[list[Holding]]) -> Sources | None:
    """The highest step at which every piece of one sharding has a holder, and the holders.

    ``holdings[r]`` is what rank ``r`` holds. For each piece the lowest holding rank is the
    source. None when no step is covered.
    """
    cuts = sorted({(h.step, h.count) for held in holdings for h in held if h.step >= 0},
                  reverse=True)
    for step, count in cuts:
        sources: dict[int, int] = {}
        for rank, held in enumerate(holdings):
            for h in held:
                if (h.step, h.count) == (step, count):
                    sources.setdefault(h.index, rank)
        if len(sources) == count:
            return Sources(step, tuple(sources[i] for i in range(count)))
    return None


def gather_holdings(
    live: list[Holding], copies: list[Holding], last_step: int, group: dist.ProcessGroup,
) -> tuple[list[list[Holding]], list[list[Holding]], int]:
    """Every rank's live pieces and snapshot copies, indexed by rank in ``group``, and the
    highest ``last_step`` (the last step any rank finished, -1 on a fresh start). Collective."""
    entries: list[Any] = [None] * dist.get_world_size(group)
    raw = [[(h.step, h.count, h.index) for h in held] for held in (live, copies)]
    dist.all_gather_object(entries, (last_step, raw), group=group)
    lives, snapshots = ([[Holding(int(s), int(c), int(i)) for s, c, i in held[side]]
                         for _, held in entries] for side in (0, 1))
    return lives, snapshots, max(int(last) for last, _ in entries)


def chunk_rows(total: int, count: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of piece ``index`` of ``total`` rows cut into ``count``, as
    ``torch.chunk`` cuts them (FSDP2's dim-0 split: trailing pieces may be short or empty)."""
    size = -(-total // count)
    return min(index * size, total), min((index + 1) * size, total)


def row_sources(total: int, count: int, start: int, stop: int) -> list[tuple[int, int, int]]:
    """Where rows ``[start, stop)`` of the full tensor lie among ``count`` old pieces:
    ``(piece, first, end)`` in that piece's own rows, in row order."""
    found = []
    for index in range(count):
        first, end = chunk_rows(total, count, index)
        lo, hi = max(start, first), min(stop, end)
        if lo < hi:
            found.append((index, lo - first, hi - first))
    return found


def fetch_rows(sources: Sources, read: Callable[[int], dict[str, Any]], group: dist.ProcessGroup,
               wants: list[tuple[int, int]], targets: list[tuple[RowSpec, torch.Tensor]]
               ) -> tuple[Piece, dict[str, Any]]:
    """Write this rank's rows of piece ``wants[rank]`` (``(count, index)``) of the state of
    ``sources.step`` into ``targets``; return what is whole (a piece without its rows) and
    piece 0's runtime metadata. Collective over ``group``.

    ``read(i)`` is called on the source of piece ``i`` only and returns
    ``{"piece": Piece, "meta": {...}}``. ``targets`` pairs every row-cut tensor's spec (its
    full shape and dtype, the same on every rank: :func:`fsdp.row_targets`) with this rank's
    local tensor of it, so every rank computes the same transfer plan without exchanging
    one. What is whole (buffers, step counts, hyperparameters, metadata) comes by one
    broadcast from piece 0's source; the rows by :func:`slice_exchange.exchange_slices`,
    each rank receiving only the rows it lacks, into its own tensors.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    held = {index: read(index) for index, src in enumerate(sources.ranks) if src == rank}
    first = held.get(0)
    whole = broadcast_state(None if first is None else {
        "whole": {side: first["piece"][side] for side in ("buffers", "optim_whole", "groups")},
        "meta": first["meta"]}, sources.ranks[0], group)
    specs = [spec for spec, _ in targets]
    for index, got in held.items():
        _check_piece(got["piece"], index, sources, specs)
    # (destination, source) -> the slices it carries, in one agreed order on both ends.
    plan: dict[tuple[int, int], list[tuple[RowSpec, int, int, int]]] = {}
    for dest, want in enumerate(wants):
        for spec in specs:
            start, stop = chunk_rows(spec.shape[0], *want)
            for old, lo, hi in row_sources(spec.shape[0], sources.count, start, stop):
                plan.setdefault((dest, sources.ranks[old]), []).append((spec, old, lo, hi))

    def held_rows(spec: RowSpec, old: int, lo: int, hi: int) -> torch.Tensor:
        return held[old]["piece"][spec.side][spec.key][lo:hi]

    def mine(spec: RowSpec, old: int, lo: int, hi: int) -> torch.Tensor:
        """Where old piece ``old``'s rows ``lo:hi`` go in this rank's own tensor."""
        local = by_spec[spec]
        at = chunk_rows(spec.shape[0], sources.count, old)[0] + lo \
            - chunk_rows(spec.shape[0], *wants[rank])[0]
        return local[at:at + hi - lo]

    by_spec = dict(targets)
    with torch.no_grad():
        for entry in plan.get((rank, rank), []):  # rows this rank holds already
            mine(*entry).copy_(held_rows(*entry))
        exchange_slices(
            [[held_rows(*entry) for entry in plan.get((dest, rank), [])] if dest != rank else []
             for dest in range(world)],
            [[mine(*entry) for entry in plan.get((rank, src), [])] if src != rank else []
             for src in range(world)], group)
    return dict(whole["whole"]), whole["meta"]


def _check_piece(piece: Piece, index: int, sources: Sources, rows: list[RowSpec]) -> None:
    """A held piece must be cut the way the plan assumes, or rows would land in wrong places."""
    for spec in rows:
        tensor = piece[spec.side].get(spec.key)
        start, stop = chunk_rows(spec.shape[0], sources.count, index)
        if (tensor is None or tuple(tensor.shape) != (stop - start, *spec.shape[1:])
                or tensor.dtype != spec.dtype):
            held = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            raise ElasticError(
                f"piece {index} of {sources.count} of step {sources.step} holds {spec.key!r} "
                f"as {held}, not rows {start}-{stop} of {spec.shape} {spec.dtype}: the model "
                "built for this round differs from the one that trained")
