"""Copies of a neighbour's shards in host memory, so that FSDP survives a node loss without storage.

Under FSDP (one sharded copy of the state, no replica) a lost node takes its pieces with it.
Gemini (SOSP'23) keeps each rank's shards in a peer's host memory; here every ``every`` steps
each rank sends its piece to its *holder*, a rank on another node (``copy_placement``: the
same local rank on the next node when nodes are equal), and keeps a :class:`Snapshot`:

* ``peers``: the pieces of the ranks it holds for (one on equal nodes; none or several on
  nodes of unequal sizes), and
* ``own``: a snapshot of its own piece at the same step.

Together they make every piece of the snapshot step available unless a node *and* the node
holding its copies are both lost: then the caller falls back to the last committed checkpoint.
Restoring from a snapshot redoes at most ``every`` steps; the sampler and step roll back with
it (its runtime metadata is kept beside it).

**Beside training, not in it.** :meth:`PeerCopies.refresh` runs at the start of a step: it
copies this rank's piece into a preallocated host buffer (one memory copy, before the step's
optimizer can change it) and hands it to a background thread, which swaps it with the ring on
a process group of its own while the step trains. A snapshot counts only once its exchange has
completed on this rank (:attr:`PeerCopies.completed`); until then the previous one stays. The
one before it also stays until the next refresh reuses its buffer: a node lost while one step's
copies have arrived on some survivors and not yet on others then still finds the step before
whole on every survivor. The next refresh first waits for the exchange in flight (normally
finished long before), through the round's abort notice, so a wait on a hung peer ends when
the agents drop it, and the step has not begun. A failed exchange (a peer died) stops copies
for the rest of the round and never fails a step by itself: the step's own collectives tell
whether the round is broken.
A copy group whose exchange did not end cleanly is abandoned, not destroyed
(``process_groups.abandon_side_group``), like every group of a failed round.

The runtime-parallel family sends its pipeline stages and tensor-parallel parts through the
same :class:`PeerCopies` (``runtime_parallel/copies.py``): a piece is any nest of tensors.

Memory per rank: two send buffers (own pieces: the newest completed snapshot's and the next
one's, or the one before) and two of each copy it holds (the newest completed, and the one
before or the one arriving): four pieces, ``4 / N`` of the state on each of N ranks, on equal
nodes; a rank holding ``k`` copies keeps ``2 + 2k``.
"""

from __future__ import annotations

import logging
import pickle
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from elastic_rt.process_groups import abandon_side_group, destroy_side_group
from elastic_rt.worker import abort
from elastic_rt.worker.trainers.sharded.fsdp import Piece
from elastic_rt.worker.trainers.sharded.row_fetch import Holding
from elastic_rt.worker.trainers.replica_broadcast import join_tensors, split_tensors, tensor_slots

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """One step's own piece and the copies held, with the runtime state of that step."""

    step: int
    count: int
    own_index: int
    peer_indices: tuple[int, ...]
    own: Piece
    peers: list[Piece]
    meta: dict[str, Any]

    def holdings(self) -> list[Holding]:
        return [Holding(self.step, self.count, index)
                for index in (self.own_index, *self.peer_indices)]

    def piece(self, index: int) -> Piece:
        if index == self.own_index:
            return self.own
        return self.peers[self.peer_indices.index(index)]


@dataclass(frozen=True)
class Ring:
    """Where one rank's copy goes, whose copies it keeps, and which pieces they are."""

    to: int
    sources: tuple[int, ...]
    count: int
    own_index: int
    peer_indices: tuple[int, ...]


class PeerCopies:
    """One round's exchange of snapshots along the ring, run beside training.

    Used from the training thread only; the exchange itself runs on ``group`` (this object's
    own, made by ``process_groups.side_group``) from a daemon thread it starts per refresh.
    """

    def __init__(self, group: dist.ProcessGroup, ring: Ring, *, every: int) -> None:
        self._group, self._ring, self._every = group, ring, every
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next = 0  # the send buffer the next refresh fills (not the newest's)
        self._lock = threading.Lock()
        self._completed: list[Snapshot] = []  # at most the two newest, oldest first
        self._pending: Future[BaseException | None] | None = None
        self._started = -1  # the step of the newest snapshot handed to the thread
        self._failed = False  # an exchange failed: no more copies this round
        self._closed = False
        self._peer_bytes = 0  # of all the copies held

    @property
    def completed(self) -> list[Snapshot]:
        """The snapshots whose exchange completed on this rank and whose buffers are intact:
        the newest, and the one before it until the next refresh; oldest first."""
        with self._lock:
            return list(self._completed)

    def is_due(self, committed: int) -> bool:
        """Whether the step after ``committed`` refreshes (every ``every`` steps)."""
        return (not self._failed and not self._closed and committed >= 0
                and (self._started < 0 or committed - self._started >= self._every))

    def refresh(self, committed: int, piece: Piece, meta: dict[str, Any]) -> None:
        """Snapshot ``piece`` (the state of step ``committed``) and send it along the ring
        in the background. Call it before the step changes the state.

        Raises:
            RoundAbandoned: the round's notice came while the previous exchange was in flight.
        """
        self._settle()
        if self._failed or self._closed:
            return
        with self._lock:  # the buffer about to be filled holds the older snapshot's own piece
            self._completed = self._completed[-1:]
        skeleton, tensors = split_tensors(piece)
        places = _places(skeleton)
        nbytes = places[-1][0] + places[-1][1] if places else 0
        buffer = self._buffers[self._next]
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._buffers[self._next] = torch.empty(nbytes, dtype=torch.uint8)
        for (offset, size, _, _), tensor in zip(places, tensors):
            buffer[offset:offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
        self._next = 1 - self._next
        own = join_tensors(skeleton, _views(skeleton, buffer))
        future: Future[BaseException | None] = Future()
        self._pending, self._started = future, committed
        args = (committed, skeleton, buffer, own, meta, future)
        threading.Thread(target=self._exchange, args=args, name=f"peer-copies-{committed}",
                         daemon=True).start()

    def close(self) -> list[Snapshot]:
        """Stop copying; the :attr:`completed` snapshots. Never raises.

        Waits for the exchange in flight (so that a clean re-form keeps its snapshot) unless
        the round's notice comes first; the copy group is destroyed if every exchange ended
        cleanly, else abandoned (a send or receive may still be blocked on a hung peer).
        """
        if self._closed:
            return self.completed
        clean = not self._failed
        if self._pending is not None:
            try:
                clean = abort.wait(self._pending) is None and clean
            except abort.RoundAbandoned:
                clean = False
            self._pending = None
        with self._lock:
            self._closed = True
            completed = list(self._completed)
        if clean:
            destroy_side_group(self._group)
        else:
            abandon_side_group(self._group)
        return completed

    def host_bytes(self) -> int:
        """The host memory the copies take, once two exchanges have completed."""
        return sum(b.numel() for b in self._buffers if b is not None) + 2 * self._peer_bytes

    def _settle(self) -> None:
        """Wait for the exchange in flight; a failed one stops copies for the round."""
        pending = self._pending
        if pending is None:
            return
        error = abort.wait(pending)  # RoundAbandoned goes up: the step has not begun
        self._pending = None
        if error is not None:
            self._failed = True
            logger.warning("peer copy of step %d failed (%s); no more peer copies this round",
                           self._started, str(error).splitlines()[0] if str(error) else
                           type(error).__name__)

    def _exchange(self, step: int, skeleton: Any, payload: torch.Tensor, own: Piece,
                  meta: dict[str, Any], future: Future[BaseException | None]) -> None:
        """The background thread: swap with the ring, then publish the snapshot."""
        ring = self._ring
        try:
            peers, self._peer_bytes = exchange(skeleton, payload, to=ring.to,
                                               sources=ring.sources, group=self._group)
        except BaseException as exc:  # reported to the training thread by the future
            future.set_result(exc)
            return
        snapshot = Snapshot(step=step, count=ring.count, own_index=ring.own_index,
                            peer_indices=ring.peer_indices, own=own, peers=peers, meta=meta)
        with self._lock:
            if not self._closed:  # a late completion after close() is not used
                self._completed = [*self._completed[-1:], snapshot]
        future.set_result(None)


def exchange(skeleton: Any, payload: torch.Tensor, *, to: int, sources: tuple[int, ...],
             group: dist.ProcessGroup) -> tuple[list[Piece], int]:
    """Send a packed piece to rank ``to`` and receive the pieces of ``sources`` (and their
    size in bytes). Collective along the placement; blocking (gloo's point-to-point work has
    no future).

    Structure and sizes travel first (a small pickled header, between our own processes), then
    the tensors as the one byte buffer ``payload`` that :meth:`PeerCopies.refresh` packed.

    Raises:
        RuntimeError: a peer is gone, or the group's timeout passed.
    """
    header = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
    sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64)
    their_sizes = [torch.empty(2, dtype=torch.int64) for _ in sources]
    _send_and_receive(sizes, their_sizes, to, sources, group)
    their_headers = [torch.empty(int(size[0]), dtype=torch.uint8) for size in their_sizes]
    their_payloads = [torch.empty(int(size[1]), dtype=torch.uint8) for size in their_sizes]
    _send_and_receive(header, their_headers, to, sources, group)
    _send_and_receive(payload, their_payloads, to, sources, group)
    pieces = []
    for their_header, their_payload in zip(their_headers, their_payloads):
        their_skeleton = pickle.loads(their_header.numpy().tobytes())
        pieces.append(join_tensors(their_skeleton, _views(their_skeleton, their_payload)))
    return pieces, sum(p.numel() for p in their_payloads)


def _send_and_receive(mine: torch.Tensor, theirs: list[torch.Tensor], to: int,
                      sources: tuple[int, ...], group: dist.ProcessGroup) -> None:
    works = [dist.isend(mine, group=group, group_dst=to)]
    works += [dist.irecv(buffer, group=group, group_src=source)
              for buffer, source in zip(theirs, sources)]
    for work in works:
        assert work is not None
        work.wait()


_ALIGN = 16
"""Each tensor starts at a multiple of this in a packed buffer, so that a byte view can be
viewed as any dtype (a view needs its offset divisible by the element size)."""


def _places(skeleton: Any) -> list[tuple[int, int, tuple[int, ...], torch.dtype]]:
    """(offset, bytes, shape, dtype) of each tensor of a skeleton in its packed buffer."""
    places, offset = [], 0
    for shape, dtype in tensor_slots(skeleton):
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        places.append((offset, size, shape, dtype))
        offset += -(-size // _ALIGN) * _ALIGN
    return places


def _views(skeleton: Any, payload: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a skeleton stands for, as views into the packed buffer holding them."""
    return [payload[offset:offset + size].view(dtype).reshape(shape)
            for offset, size, shape, dtype in _places(skeleton)]
