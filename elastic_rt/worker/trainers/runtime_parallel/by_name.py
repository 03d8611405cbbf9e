"""Move state by name: every rank gets, of each tensor it holds in the new cut, exactly the
part it holds, from the ranks that held it in the old cut, whatever the two cuts are
(pp3 -> pp2 x tp2, tp2 -> dp2...).

Rule: the state is keyed by the unsplit model's names (``model/layers.2.up.weight``,
``optimizer/state.layers.2.up.weight.exp_avg``), and every rank says how it holds each key
(:class:`Entry`): whole, or a box of it. A tensor-parallel shard is piece ``index`` of
``count`` cut along ``dim`` as ``torch.chunk`` cuts it; an FSDP shard of it is a run of rows
(dim 0) of that tensor-parallel piece, so still a box (:func:`local_box`). Each piece is a
box of the whole tensor; replicas (HSDP, dp) hold equal boxes and one is read. A
receiver gets, from each source piece, the intersection of that piece's box and its own,
in one all-to-all of the world group, written straight into its tensors. No rank receives
a byte it does not hold afterwards, so no rank ever holds the whole model unless it holds
all of it in the new cut. Non-tensor values (hyperparameters) travel with the small
description of what each rank holds.

:func:`pieces_of` and :func:`overlap` are the pure decisions; :func:`fetch_by_name` the
thin collective part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from elastic_rt.errors import ElasticError
from elastic_rt.worker.trainers.sharded.row_fetch import chunk_rows
from elastic_rt.worker.trainers.slice_exchange import exchange_slices

Box = tuple[tuple[int, int], ...]
"""``[start, stop)`` along every dimension of the whole tensor."""


@dataclass(frozen=True, slots=True)
class Entry:
    """How one rank holds one named tensor."""

    full: tuple[int, ...]
    """The whole tensor's shape."""
    dtype: torch.dtype
    dim: int | None = None
    """The dimension the whole is cut along; None: it holds the whole."""
    index: int = 0
    count: int = 1
    held: Box | None = None
    """The box held, when given as one (a DTensor's local shard); else from dim/index/count."""

    def box(self) -> Box:
        """The part of the whole this entry holds."""
        if self.held is not None:
            return self.held
        return tuple(chunk_rows(size, self.count, self.index) if d == self.dim else (0, size)
                     for d, size in enumerate(self.full))


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes; None when it is empty."""
    both = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in both) else both


def flatten(state: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{"model": {...}, "optimizer": {...}}`` as one flat dict of ``side/key``."""
    return {f"{side}/{key}": value for side, part in state.items() for key, value in part.items()}


def entry_of(value: torch.Tensor) -> Entry:
    """How ``value`` holds its tensor: the box of a DTensor's local shard, or whole."""
    full = tuple(value.shape)
    if isinstance(value, DTensor):
        box = local_box(value)
        if box != tuple((0, size) for size in full):
            return Entry(full, value.dtype, held=box)
    return Entry(full, value.dtype)


def local_box(value: DTensor) -> Box:
    """The box of the whole tensor that ``value``'s local shard holds.

    ``Shard`` placements cut in mesh order, as ``torch.chunk`` does; a ``_StridedShard``
    (FSDP2's dp placement of a tensor-parallel piece cut along the same dim, e.g. a
    column-parallel weight under ``fsdp2xtp2``) cuts after the plain ones: FSDP chunks
    the tensor-parallel *local* tensor by rows, so the local shard is a run of rows of a
    run of rows: still one box.

    Raises:
        ElasticError: the local shard is not that box (a placement this does not know).
    """
    # the mesh's own record: its group may be gone with the round that made it
    coordinate = value.device_mesh.get_coordinate()
    assert coordinate is not None  # a DTensor lives on the ranks of its mesh
    placements = list(enumerate(value.placements))
    cuts = [(i, p.dim) for i, p in placements if isinstance(p, Shard)]
    cuts += [(i, p.dim) for i, p in reversed(placements) if isinstance(p, _StridedShard)]
    box = [(0, size) for size in value.shape]
    for axis, dim in cuts:
        lo, hi = box[dim]
        first, end = chunk_rows(hi - lo, value.device_mesh.size(axis), coordinate[axis])
        box[dim] = (lo + first, lo + end)
    if tuple(hi - lo for lo, hi in box) != tuple(value.to_local().shape):
        raise ElasticError(f"a DTensor placed {value.placements} holds a local shard of shape "
                           f"{tuple(value.to_local().shape)}, not the box {box} of "
                           f"{tuple(value.shape)}: it cannot move by name")
    return tuple(box)


def describe(flat: dict[str, Any]) -> dict[str, Any]:
    """What a rank holds: an :class:`Entry` per tensor, the value itself otherwise."""
    return {key: entry_of(v) if isinstance(v, torch.Tensor) else v for key, v in flat.items()}


def pieces_of(key: str, held: dict[int, dict[str, Any]]) -> list[tuple[int, Entry]]:
    """The ``(source rank, entry)`` of each piece of ``key``, in piece order.

    A whole tensor comes from its lowest holder; a cut one needs a holder per piece (the
    lowest, among replicas holding the same box), and the pieces must cover the whole.

    Raises:
        ElasticError: a piece has no holder (the sources do not cover the model).
    """
    found = sorted((rank, entries[key]) for rank, entries in held.items()
                   if isinstance(entries.get(key), Entry))
    if not found:
        raise ElasticError(f"no source holds {key!r}: the model built for this round "
                           "differs from the one that trained")
    by_box: dict[Box, tuple[int, Entry]] = {}
    for rank, entry in found:
        by_box.setdefault(entry.box(), (rank, entry))
    whole = tuple((0, size) for size in found[0][1].full)
    if whole in by_box:
        return [by_box[whole]]
    # the pieces of one cut do not overlap: they cover the whole when their volumes add up
    if sum(math.prod(hi - lo for lo, hi in box) for box in by_box) != math.prod(
            hi for _, hi in whole):
        raise ElasticError(f"the surviving pieces {sorted(by_box)} of {key!r} do not cover "
                           f"its shape {found[0][1].full}")
    return [by_box[box] for box in sorted(by_box)]


Move = tuple[str, Entry, Box]
"""One transfer: the key, the source's piece, the box of the whole that goes."""


def plan_moves(sources: dict[int, dict[str, Any]],
               wanted: list[dict[str, Any]]) -> dict[tuple[int, int], list[Move]]:
    """``(destination, source)`` -> what goes between them, in one agreed order.

    ``wanted[d]`` is rank ``d``'s description of its new state: for each of its tensors, the
    part of it that it holds.
    """
    plan: dict[tuple[int, int], list[Move]] = {}
    keys = sorted({key for want in wanted for key, entry in want.items()
                   if isinstance(entry, Entry)})
    for key in keys:
        pieces = pieces_of(key, sources)
        for dest, want in enumerate(wanted):
            target = want.get(key)
            if not isinstance(target, Entry):
                continue
            for src, piece in pieces:
                box = overlap(piece.box(), target.box())
                if box is not None:
                    plan.setdefault((dest, src), []).append((key, piece, box))
    return plan


@dataclass(frozen=True, slots=True)
class Offer:
    """One state a source can send from: its live state, or a snapshot of a part."""

    described: dict[str, Any]
    """An :class:`Entry` per tensor, the value itself otherwise (:func:`describe`)."""
    tensors: dict[str, torch.Tensor]
    """Each tensor's local part (a DTensor's local shard), by key."""


def offer_of(flat: dict[str, Any]) -> Offer:
    """A flat live state (DTensors where it is tensor-parallel) as an :class:`Offer`."""
    return Offer(describe(flat), {key: _local(value) for key, value in flat.items()
                                  if isinstance(value, torch.Tensor)})


def fetch_by_name(held: dict[str, Any] | None, targets: dict[str, Any],
                  group: dist.ProcessGroup) -> None:
    """Fill ``targets`` (this rank's new state, flat) from the sources' ``held`` state.

    Collective over ``group``; ``held`` is None on ranks that are not sources. Tensors are
    written in place (a DTensor's local shard); other values are replaced in ``targets``.
    """
    fetch_offers([] if held is None else [offer_of(held)], targets, group)


def fetch_offers(offers: list[Offer], targets: dict[str, Any],
                 group: dist.ProcessGroup) -> None:
    """:func:`fetch_by_name` where a rank may send from several states (its own part and
    the copy of a neighbour's, ``copies``) or none (``offers`` empty). Collective."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    entries: list[Any] = [None] * world
    dist.all_gather_object(entries, ([o.described for o in offers], describe(targets)),
                           group=group)
    # every offer is one source of the plan, numbered rank by rank: offer i of rank r is
    # source r * slots + i (the lowest holder of a whole tensor stays the lowest rank)
    slots = max(1, *(len(offered) for offered, _ in entries))
    sources = {r * slots + i: described for r, (offered, _) in enumerate(entries)
               for i, described in enumerate(offered)}
    plan = plan_moves(sources, [want for _, want in entries])

    def moves(dest: int, src: int) -> list[tuple[Move, int]]:
        return [(move, slot) for slot in range(slots)
                for move in plan.get((dest, src * slots + slot), [])]
    for key in [k for k, v in targets.items() if not isinstance(v, torch.Tensor)]:
        targets[key] = _value_of(key, sources)
    with torch.no_grad():
        converted = []  # places whose dtype differs from the sender's: filled, then cast

        def place(key: str, piece: Entry, box: Box) -> torch.Tensor:
            region = _region(targets[key], box)
            if region.dtype == piece.dtype:
                return region
            staged = torch.empty(region.shape, dtype=piece.dtype)
            converted.append((region, staged))
            return staged
        exchange_slices([[_offered(offers[slot], key, box) for (key, _, box), slot in
                          moves(dest, rank)] for dest in range(world)],
                        [[place(*move) for move, _ in moves(rank, src)] for src in range(world)],
                        group)
        for region, staged in converted:
            region.copy_(staged)


def _offered(offer: Offer, key: str, box: Box) -> torch.Tensor:
    """The view of an offer's tensor ``key`` that holds ``box``."""
    return _within(offer.tensors[key], offer.described[key].box(), box)


def _region(value: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``value``'s own tensor (a DTensor's local shard) that holds ``box``."""
    return _within(_local(value), entry_of(value).box(), box)


def _within(local: torch.Tensor, held: Box, box: Box) -> torch.Tensor:
    """The view of ``local``, which holds the part ``held`` of the whole, that holds ``box``."""
    return local[tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(box, held))]


def _value_of(key: str, sources: dict[int, dict[str, Any]]) -> Any:
    """A value that is not a tensor (a hyperparameter), from its lowest holder."""
    for _, held in sorted(sources.items()):
        if key in held:
            return held[key]
    raise ElasticError(f"no source holds {key!r}: the model built for this round "
                       "differs from the one that trained")


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
