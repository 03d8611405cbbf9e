"""Restore a sharded state after a re-form from the pieces that survived, wherever they are.

Under FSDP every rank holds one piece (its rows) of the state; under HSDP each piece is held
once per replica group. After a node loss the survivors still hold their pieces of the last
step they finished, and ranks may hold copies of a neighbour's pieces (``peer_copies``). The
state can be rebuilt without storage when, for one step, every piece ``0..n-1`` of one
sharding ``n`` has a holder: the highest such step wins. Otherwise the caller falls back to
the last committed checkpoint, resharded.

:func:`pick_piece_sources` is the pure decision; :func:`gather_holdings` and
:func:`fetch_full` are the thin collective parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from elastic_rt.worker.fsdp import Piece, join_pieces
from elastic_rt.worker.state_sync import broadcast_state


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


def fetch_full(sources: Sources, read: Callable[[int], dict[str, Any]],
               group: dist.ProcessGroup) -> tuple[Piece, dict[str, Any]]:
    """The full state of ``sources.step`` on every rank, and piece 0's runtime metadata.

    ``read(i)`` is called on the source of piece ``i`` only and returns
    ``{"piece": Piece, "meta": {...}}``. Collective: one broadcast per piece.

    Note:
        Every rank holds the full state for a moment (host memory of the state's size);
        sending each rank only its new rows would avoid that at the cost of a transfer plan.
    """
    rank = dist.get_rank(group)
    pieces: list[Piece] = []
    meta: dict[str, Any] = {}
    for index, src in enumerate(sources.ranks):
        got = broadcast_state(read(index) if rank == src else None, src, group)
        pieces.append(got["piece"])
        if index == 0:
            meta = got["meta"]
    return join_pieces(pieces), meta
