"""Move state by name: every rank gets each tensor it holds in the new cut from the ranks that
held it in the old one, whatever the two cuts are (pp3 -> pp2 x tp2, tp2 -> dp2...).

Rule: the state is keyed by the unsplit model's names (``model/layers.2.up.weight``,
``optimizer/state.layers.2.up.weight.exp_avg``), and a source says how it holds each key
(:class:`Entry`): whole, or piece ``index`` of ``count`` cut along ``dim`` (a tensor-parallel
DTensor shard). For every key a rank needs, the pieces of it come from their sources in one
all-to-all of the world group, and the rank keeps its own part of the whole: its
tensor-parallel shard, or all of it.

Note:
    A receiver gets every piece of the keys it holds, so a tensor-parallel rank receives the
    whole tensor of each parameter it holds a shard of (``tp`` times its share) and cuts its
    own shard out: per parameter, never the whole model on one rank, but more bytes than
    a row-level transfer would move. Non-tensor values (hyperparameters) travel with the
    small description of what each source holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from elastic_rt.errors import ElasticError
from elastic_rt.worker import abort


@dataclass(frozen=True, slots=True)
class Entry:
    """How one rank holds one named tensor."""

    shape: tuple[int, ...]
    """The shape of the piece it holds."""
    dtype: torch.dtype
    dim: int | None = None
    """The dimension the whole is cut along; None: it holds the whole."""
    index: int = 0
    count: int = 1

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def flatten(state: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{"model": {...}, "optimizer": {...}}`` as one flat dict of ``side/key``."""
    return {f"{side}/{key}": value for side, part in state.items() for key, value in part.items()}


def entry_of(value: torch.Tensor) -> Entry:
    """How ``value`` holds its tensor: a DTensor sharded on one mesh axis, or whole."""
    if isinstance(value, DTensor):
        local = value.to_local()
        placement = value.placements[0]
        if isinstance(placement, Shard):
            # the mesh's own record: its group may be gone with the round that made it
            coordinate = value.device_mesh.get_coordinate()
            assert coordinate is not None  # a DTensor lives on the ranks of its mesh
            index = coordinate[0]
            return Entry(tuple(local.shape), local.dtype, placement.dim, index,
                         value.device_mesh.size())
        return Entry(tuple(local.shape), local.dtype)
    return Entry(tuple(value.shape), value.dtype)


def describe(flat: dict[str, Any]) -> dict[str, Any]:
    """What a source holds: an :class:`Entry` per tensor, the value itself otherwise."""
    return {key: entry_of(v) if isinstance(v, torch.Tensor) else v for key, v in flat.items()}


def pieces_of(key: str, held: dict[int, dict[str, Any]]) -> list[tuple[int, Entry]]:
    """The ``(source rank, entry)`` of each piece of ``key``, in piece order.

    A whole tensor comes from its lowest holder; a cut one needs one holder per piece.

    Raises:
        ElasticError: a piece has no holder (the sources do not cover the model).
    """
    found = sorted((rank, entries[key]) for rank, entries in held.items()
                   if isinstance(entries.get(key), Entry))
    if not found:
        raise ElasticError(f"no source holds {key!r}: the model built for this round "
                           "differs from the one that trained")
    first = found[0][1]
    if first.dim is None:
        return [found[0]]
    by_index: dict[int, tuple[int, Entry]] = {}
    for rank, entry in found:
        by_index.setdefault(entry.index, (rank, entry))
    if sorted(by_index) != list(range(first.count)):
        raise ElasticError(f"pieces {sorted(by_index)} of {first.count} of {key!r} survive")
    return [by_index[i] for i in range(first.count)]


def fetch_by_name(held: dict[str, Any] | None, targets: dict[str, Any],
                  group: dist.ProcessGroup) -> None:
    """Fill ``targets`` (this rank's new state, flat) from the sources' ``held`` state.

    Collective over ``group``; ``held`` is None on ranks that are not sources. Tensors are
    written in place (a DTensor's local shard); other values are replaced in ``targets``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    entries: list[Any] = [None] * world
    dist.all_gather_object(entries, (None if held is None else describe(held), sorted(targets)),
                           group=group)
    sources = {r: described for r, (described, _) in enumerate(entries) if described is not None}
    needed = sorted({key for _, keys in entries for key in keys})
    plan = {key: pieces_of(key, sources) for key in needed
            if not any(key in s and not isinstance(s[key], Entry) for s in sources.values())}
    for key in list(targets):
        if key not in plan:
            targets[key] = _value_of(key, sources)
    needs = [set(keys) for _, keys in entries]
    send = [_pack([_local(held[key]) for key, pieces in plan.items()  # type: ignore[index]
                   if dest in _needing(key, needs) for src, _ in pieces if src == rank])
            for dest in range(world)]
    sizes = [sum(e.nbytes for key, pieces in plan.items() if key in needs[rank]
                 for s, e in pieces if s == src) for src in range(world)]
    received = torch.empty(sum(sizes), dtype=torch.uint8)
    work = dist.all_to_all_single(received, torch.cat(send), output_split_sizes=sizes,
                                  input_split_sizes=[part.numel() for part in send],
                                  group=group, async_op=True)
    assert work is not None  # async_op=True always returns a Work
    abort.wait(work.get_future())
    _unpack(received, sizes, plan, targets)


def _value_of(key: str, sources: dict[int, dict[str, Any]]) -> Any:
    """A value that is not a tensor (a hyperparameter), from its lowest holder."""
    for _, held in sorted(sources.items()):
        if key in held:
            return held[key]
    raise ElasticError(f"no source holds {key!r}: the model built for this round "
                       "differs from the one that trained")


def _needing(key: str, needs: list[set[str]]) -> list[int]:
    return [dest for dest, keys in enumerate(needs) if key in keys]


def _unpack(received: torch.Tensor, sizes: list[int], plan: dict[str, list[tuple[int, Entry]]],
            targets: dict[str, Any]) -> None:
    """Each key's pieces out of the received bytes (per source, in key order), joined and
    cut to the target's own part."""
    offsets = [sum(sizes[:src]) for src in range(len(sizes))]
    with torch.no_grad():
        for key, pieces in plan.items():
            if key not in targets:
                continue
            parts = []
            for src, entry in pieces:
                data = received[offsets[src]:offsets[src] + entry.nbytes]
                offsets[src] += entry.nbytes
                parts.append(data.clone().view(entry.dtype).reshape(entry.shape))
            dim = pieces[0][1].dim
            whole = parts[0] if dim is None else torch.cat(parts, dim=dim)
            _write(targets[key], whole)


def _write(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's part of ``whole`` into ``target`` (all of it, or its shard)."""
    mine = entry_of(target)
    local = _local(target)
    if mine.dim is None:
        local.copy_(whole.reshape(local.shape))
        return
    chunks = list(torch.chunk(whole, mine.count, dim=mine.dim))
    local.copy_(chunks[mine.index])


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
