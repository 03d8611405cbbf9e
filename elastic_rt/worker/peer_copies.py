"""Copies of a neighbour's shards in host memory, so that FSDP survives a node loss without storage.

Under FSDP (one sharded copy of the state, no replica) a lost node takes its pieces with it.
Gemini (SOSP'23) keeps each rank's shards in a peer's host memory; here every ``every`` steps
each rank sends its piece to its *ring holder*, the rank one node further on
(``rank + ranks_per_node``, so the copy lives on another node), and keeps:

* ``peer``: the piece of the rank it holds for, and
* ``own``: a snapshot of its own piece at the same step.

Together they make every piece of the snapshot step available unless a node *and* the node
holding its copies are both lost: then the caller falls back to the last committed checkpoint.
Restoring from a snapshot redoes at most ``every`` steps; the sampler and step roll back with
it (its runtime metadata is kept beside it). The exchange runs at the start of a step, before
its forward: if a peer dies during it, the step fails with the state untouched, and the
previous snapshot stays until a new one has fully arrived.

Cost: two pieces of extra host memory per rank (its own snapshot and its neighbour's copy),
and one send and one receive of a piece every ``every`` steps, in the training stream.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_rt.worker.fsdp import Piece
from elastic_rt.worker.piece_sync import Holding
from elastic_rt.worker.state_sync import join_tensors, split_tensors, tensor_slots

logger = logging.getLogger(__name__)


def ring_holder(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank that keeps ``rank``'s copy: the same local rank on the next node."""
    return (rank + ranks_per_node) % world_size


@dataclass
class Snapshot:
    """One step's own piece and neighbour's copy, with the runtime state of that step."""

    step: int
    count: int
    own_index: int
    peer_index: int
    own: Piece
    peer: Piece
    meta: dict[str, Any]

    def holdings(self) -> list[Holding]:
        return [Holding(self.step, self.count, self.own_index),
                Holding(self.step, self.count, self.peer_index)]

    def piece(self, index: int) -> Piece:
        return self.own if index == self.own_index else self.peer

    def nbytes(self) -> int:
        """Host memory the two pieces hold."""
        _, tensors = split_tensors({"own": self.own, "peer": self.peer})
        return sum(t.numel() * t.element_size() for t in tensors)


def exchange(piece: Piece, *, to: int, source: int, group: dist.ProcessGroup) -> Piece:
    """Send ``piece`` to rank ``to`` and receive rank ``source``'s. Collective along the ring.

    Structure and sizes travel first (a small pickled header, between our own processes), then
    every tensor as one byte buffer.

    Raises:
        RuntimeError: a peer is gone.
    """
    skeleton, tensors = split_tensors(piece)
    header = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
    payload = (torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
               if tensors else torch.empty(0, dtype=torch.uint8))
    sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64)
    their_sizes = torch.empty(2, dtype=torch.int64)
    _swap(sizes, their_sizes, to, source, group)
    their_header = torch.empty(int(their_sizes[0]), dtype=torch.uint8)
    their_payload = torch.empty(int(their_sizes[1]), dtype=torch.uint8)
    _swap(header, their_header, to, source, group)
    _swap(payload, their_payload, to, source, group)
    their_skeleton = pickle.loads(their_header.numpy().tobytes())
    return join_tensors(their_skeleton, _unpack(their_skeleton, their_payload))


def _swap(mine: torch.Tensor, theirs: torch.Tensor, to: int, source: int,
          group: dist.ProcessGroup) -> None:
    ops = [dist.P2POp(dist.isend, mine, group=group, group_peer=to),
           dist.P2POp(dist.irecv, theirs, group=group, group_peer=source)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _unpack(skeleton: Any, payload: torch.Tensor) -> list[torch.Tensor]:
    tensors, offset = [], 0
    for shape, dtype in tensor_slots(skeleton):
        count = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        chunk = payload[offset:offset + count]
        tensors.append(chunk.view(dtype).reshape(shape).clone())
        offset += count
    return tensors
