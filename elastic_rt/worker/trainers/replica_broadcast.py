"""One rank's state, whole, to every rank of a group: a few collectives, one per dtype.

Rule: :func:`broadcast_state` sends a nested dict of tensors and plain values from ``src``;
the structure (keys, shapes, dtypes, plain values such as param_groups) travels as one
small pickled object, the tensors as one flat buffer per dtype, so a model of many small
tensors costs a few collectives, not thousands.

Its users send what every rank needs whole: rank 0's initial model on a fresh start, a
model-parallel part's state (``model_parallel/part_broadcast.py``), FSDP rows
(``sharded/row_fetch.py``), and the replicated family's small ``Outline``. A replica's
tensors go point to point, only to the ranks that lack them (``replica_transfer.py``).
The collectives are waited on through the round's abort notice (``worker/abort.py``) and
receive into fresh buffers, so one abandoned by a newer round writes into nothing the
next round reads.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_rt.worker import abort


@dataclass(frozen=True, slots=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_state(state: Any, src: int, group: dist.ProcessGroup) -> Any:
    """Return ``state`` as held by rank ``src`` (the argument is ignored elsewhere).

    ``src`` is a rank of ``group``. Nested dicts, lists and tuples of tensors and
    plain values are supported (a model's and an optimizer's state_dict).
    """
    is_source = dist.get_rank(group) == src
    tensors: list[torch.Tensor] = []
    skeleton = _strip(state, tensors) if is_source else None
    skeleton = _broadcast_object(skeleton, src, group)
    slots: list[_TensorSlot] = []
    _collect_slots(skeleton, slots)
    received = _broadcast_tensors(tensors if is_source else None, slots, src, group)
    return _fill(skeleton, received)


def _broadcast_object(value: Any, src: int, group: dist.ProcessGroup) -> Any:
    """``broadcast_object_list`` for one object, but waited on through the abort notice
    (torch's is a blocking call). Peers of one job trust each other, as torch's does."""
    data = (torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
            if dist.get_rank(group) == src else None)
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    _wait(dist.broadcast(size, group_src=src, group=group, async_op=True))
    buffer = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.broadcast(buffer, group_src=src, group=group, async_op=True))
    return value if data is not None else pickle.loads(buffer.numpy().tobytes())


def _wait(work: dist.Work | None) -> None:
    assert work is not None  # async_op=True always returns a Work
    abort.wait(work.get_future())


def _strip(value: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        out.append(value.detach().cpu().contiguous())
        return _TensorSlot(len(out) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _strip(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, out) for v in value)
    return value


def _collect_slots(skeleton: Any, out: list[_TensorSlot]) -> None:
    if isinstance(skeleton, _TensorSlot):
        out.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _collect_slots(v, out)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _collect_slots(v, out)


def _broadcast_tensors(
    tensors: list[torch.Tensor] | None, slots: list[_TensorSlot], src: int, group: dist.ProcessGroup
) -> dict[int, torch.Tensor]:
    by_dtype: dict[torch.dtype, list[_TensorSlot]] = {}
    for slot in sorted(slots, key=lambda s: s.index):
        by_dtype.setdefault(slot.dtype, []).append(slot)
    result: dict[int, torch.Tensor] = {}
    for dtype, group_slots in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        sizes = [int(torch.Size(s.shape).numel()) for s in group_slots]
        if tensors is not None:
            flat = torch.cat([tensors[s.index].reshape(-1) for s in group_slots])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype)
        _wait(dist.broadcast(flat, group_src=src, group=group, async_op=True))
        for slot, piece in zip(group_slots, torch.split(flat, sizes)):
            result[slot.index] = piece.view(slot.shape).clone()
    return result


def _fill(skeleton: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` as (a picklable skeleton, its tensors in order), for sending elsewhere."""
    tensors: list[torch.Tensor] = []
    return _strip(state, tensors), tensors


def tensor_slots(skeleton: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor a skeleton of :func:`split_tensors` stands for, in order."""
    slots: list[_TensorSlot] = []
    _collect_slots(skeleton, slots)
    return [(slot.shape, slot.dtype) for slot in sorted(slots, key=lambda s: s.index)]


def join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The state :func:`split_tensors` split, from its skeleton and tensors."""
    return _fill(skeleton, dict(enumerate(tensors)))
