"""Copies of a neighbour's shards in host memory, so that FSDP survives a node loss without storage.

Under FSDP (one sharded copy of the state, no replica) a lost node takes its pieces with it.
Gemini (SOSP'23) keeps each rank's shards in a peer's host memory; here every ``every`` steps
each rank snapshots its piece and sends a copy to its *holder*, a rank on another node
(``copy_placement``: the same local rank on the next node when nodes are equal), and keeps
:class:`Snapshot` s of

* its own piece, and
* the pieces of the ranks it holds copies for (one on equal nodes; none or several on nodes
  of unequal sizes),

each with the step it is at. Together they make every piece of a step available unless a
node *and* the node holding its copies are both lost: then the caller falls back to the last
committed checkpoint. Restoring from a snapshot redoes at most ``every`` steps; the sampler
and step roll back with it (its runtime metadata travels with each copy).

**Beside training, not in it.** :meth:`PeerCopies.refresh` runs as a step ends (after its optimizer
step, and once after a restore): it copies this rank's piece into a preallocated host buffer (one
memory copy, before the next step's optimizer can change it), which counts as this rank's snapshot
at once, and hands it to a background thread that sends it to the holder on a process group of its
own while the next step trains. The holder is always ready for it: a receiving thread per rank it
holds for waits for the next copy the whole round, so a copy lands as soon as its rank has finished
its step, whatever its holder is doing. (Until 2026-12-06 two ranks swapped copies at the start of
their next steps in one exchange that both had to start: a copy then landed only once the slower
rank got there, and a node killed in that window cost one step more.) A copy counts once it has
arrived whole; the two newest of each piece are kept, so a node lost while one step's copies have
arrived on some survivors and not yet on others still finds the step before whole on every survivor.
Before a step changes the state the trainer waits for the send in flight (:meth:`PeerCopies.settle`;
normally finished long before), through the round's abort notice, so a wait on a hung peer ends when
the agents drop it, and the step has not begun; the refresh at its end then never waits. A failed
send (a peer died) stops copies for the rest of the round and never fails a step by itself: the
step's own collectives tell whether the round is broken. :meth:`PeerCopies.close` sends each holder
an end mark that stops its receiving thread; a copy group where anything did not end cleanly is
abandoned, not destroyed (``process_groups.abandon_side_group``), like every group of a failed
round.

The runtime-parallel family sends its pipeline stages and tensor-parallel parts through the
same :class:`PeerCopies` (``runtime_parallel/copies.py``): a piece is any nest of tensors.

Memory per rank: two send buffers (its own newest snapshot and the one before) and two of
each copy it holds (and a third while one arrives): four pieces, ``4 / N`` of the state on
each of N ranks, on equal nodes; a rank holding ``k`` copies keeps ``2 + 2k``. After a node
loss a send or receive blocked on the dead peer keeps the one buffer it was moving until
gloo gives up (the collective timeout); :meth:`PeerCopies.close` lets go of the rest.
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
    """One piece at one step (this rank's own, or a copy it holds), with the runtime state
    of that step."""

    step: int
    count: int
    index: int
    piece: Piece
    meta: dict[str, Any]

    def holding(self) -> Holding:
        return Holding(self.step, self.count, self.index)


@dataclass(frozen=True)
class Ring:
    """Where one rank's copy goes, whose copies it keeps, and which pieces they are."""

    to: int
    sources: tuple[int, ...]
    count: int
    own_index: int
    peer_indices: tuple[int, ...]


_LANDED_POLL_S = 0.02
"""How often :meth:`PeerCopies.wait_landed` looks at the round's notice and the receivers."""

_KEPT = 2
"""Snapshots kept of each piece: the newest, and the one before it for a step whose copies
reached some survivors only."""


class PeerCopies:
    """One round's copies: sent beside training, received by a thread per rank held for.

    Used from the training thread only; the sends run on ``group`` (this object's own, made
    by ``process_groups.side_group``) from a daemon thread per refresh, the receives from a
    daemon thread per source for the whole round.
    """

    def __init__(self, group: dist.ProcessGroup, ring: Ring, *, every: int) -> None:
        self._group, self._ring, self._every = group, ring, every
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next = 0  # the send buffer the next refresh fills (not the newest's)
        self._lock = threading.Condition()  # notified as each copy lands
        self._own: list[Snapshot] = []  # at most the two newest, oldest first
        self._held: dict[int, list[Snapshot]] = {index: [] for index in ring.peer_indices}
        self._payloads: dict[int, list[torch.Tensor]] = {}  # the held copies' buffers
        self._sending: Future[BaseException | None] | None = None
        self._started = -1  # the step of the newest snapshot handed to the sender
        self._failed = False  # a send failed: no more copies this round
        self._closed = False
        self._receiving = [self._receive_from(source, index)
                           for source, index in zip(ring.sources, ring.peer_indices)]

    @property
    def completed(self) -> list[Snapshot]:
        """This rank's snapshots and the copies that arrived whole, the two newest of each
        piece, oldest first within a piece."""
        with self._lock:
            return [*self._own, *(s for held in self._held.values() for s in held)]

    def is_due(self, committed: int) -> bool:
        """Whether the step after ``committed`` refreshes (every ``every`` steps)."""
        return (not self._failed and not self._closed and committed >= 0
                and (self._started < 0 or committed - self._started >= self._every))

    def refresh(self, committed: int, piece: Piece, meta: dict[str, Any]) -> None:
        """Snapshot ``piece`` (the state of step ``committed``) and send it to the holder in
        the background, unless that step was sent already. Call it between steps, after
        :meth:`settle` (then it never waits).

        Raises:
            RoundAbandoned: the round's notice came while the previous send was in flight.
        """
        self.settle()
        if self._failed or self._closed or committed == self._started:  # that step went
            return
        with self._lock:  # the buffer about to be filled holds the older snapshot
            self._own = self._own[-1:]
        skeleton, tensors = split_tensors(piece)
        places = _places(skeleton)
        nbytes = places[-1][0] + places[-1][1] if places else 0
        buffer = self._buffers[self._next]
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._buffers[self._next] = torch.empty(nbytes, dtype=torch.uint8)
        for (offset, size, _, _), tensor in zip(places, tensors):
            buffer[offset:offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
        self._next = 1 - self._next
        own = Snapshot(committed, self._ring.count, self._ring.own_index,
                       join_tensors(skeleton, _views(skeleton, buffer)), meta)
        with self._lock:
            self._own = [*self._own, own]
        header = pickle.dumps((committed, skeleton, meta))
        self._sending, self._started = self._send(header, buffer), committed

    def close(self) -> list[Snapshot]:
        """Stop copying; hand over the :attr:`completed` snapshots (this object keeps
        none; a second call returns none). Never raises.

        Waits for the send in flight (so that a clean re-form keeps its copy), then sends
        the holder the end mark and waits for the end marks of the ranks held for, unless
        the round's notice comes first; the copy group is destroyed if everything ended
        cleanly, else abandoned (a send or receive may still be blocked on a hung peer).
        """
        if self._closed:
            return []
        clean = not self._failed
        try:
            if self._sending is not None:
                clean = abort.wait(self._sending) is None and clean
            self._sending = None
            if clean:
                clean = abort.wait(self._send(None, None)) is None
            for receiving in self._receiving:
                clean = abort.wait(receiving) is None and clean
        except abort.RoundAbandoned:
            clean = False
        with self._lock:
            self._closed = True
            completed = [*self._own, *(s for held in self._held.values() for s in held)]
            # The caller owns them now. A send or receive still blocked on a dead peer
            # keeps this object alive until gloo gives up (up to the collective timeout),
            # and with it every buffer it lists: 1.6 GB per rank at 1.2 GB of FSDP state,
            # held through the restore and the steps after it. Only the buffer gloo is
            # reading or writing stays (the blocked call holds it).
            self._own, self._buffers, self._payloads = [], [None, None], {}
            self._held = {index: [] for index in self._held}
        if clean:
            destroy_side_group(self._group)
        else:
            abandon_side_group(self._group)
        return completed

    def wait_landed(self, step: int) -> None:
        """Until the copy of ``step`` from every rank this rank holds for has arrived whole.

        Raises:
            RoundAbandoned: the round's notice came first (a peer was dropped).
            RuntimeError: a rank held for stopped sending before its copy of ``step``.
        """
        def missing() -> list[tuple[int, Future[BaseException | None]]]:
            return [(source, receiving) for source, index, receiving in
                    zip(self._ring.sources, self._ring.peer_indices, self._receiving)
                    if not any(s.step == step for s in self._held[index])]

        with self._lock:
            while lacking := missing():
                stopped = [source for source, receiving in lacking if receiving.done()]
                if stopped:
                    raise RuntimeError(f"rank {stopped[0]} stopped sending copies before "
                                       f"its copy of step {step}")
                if abort.round_notice().is_given:
                    raise abort.RoundAbandoned(
                        f"a newer round dropped a member while the copies of step {step} "
                        "were on their way")
                self._lock.wait(_LANDED_POLL_S)

    def host_bytes(self) -> int:
        """The host memory the snapshots and copies take now."""
        with self._lock:
            held = sum(_payload_bytes(s.piece) for kept in self._held.values() for s in kept)
        return sum(b.numel() for b in self._buffers if b is not None) + held

    def settle(self) -> None:
        """Wait for the send in flight; a failed one stops copies for the round.

        Raises:
            RoundAbandoned: the round's notice came first.
        """
        sending = self._sending
        if sending is None:
            return
        error = abort.wait(sending)  # RoundAbandoned goes up: the step has not begun
        self._sending = None
        if error is not None:
            self._failed = True
            logger.warning("peer copy of step %d failed (%s); no more peer copies this round",
                           self._started, str(error).splitlines()[0] if str(error) else
                           type(error).__name__)

    def _send(self, header: bytes | None,
              payload: torch.Tensor | None) -> Future[BaseException | None]:
        """Send a packed piece (or, with None, the end mark) to the holder, in a thread."""
        future: Future[BaseException | None] = Future()
        to, group = self._ring.to, self._group  # not self: see close()

        def run() -> None:
            try:
                send_piece(header, payload, to=to, group=group)
            except BaseException as exc:  # reported to the training thread by the future
                future.set_result(exc.with_traceback(None))  # its frames held the buffers
                return
            future.set_result(None)

        threading.Thread(target=run, name="peer-copies-send", daemon=True).start()
        return future

    def _receive_from(self, source: int, index: int) -> Future[BaseException | None]:
        """Receive ``source``'s copies until its end mark, in a thread, keeping the newest."""
        future: Future[BaseException | None] = Future()
        group = self._group

        def run() -> None:
            # Between two receives this frame holds no copy: only the spare buffer, which
            # the next receive fills (see close()).
            spare = None  # the buffer of the copy the last one pushed out, received into next
            try:
                while (received := receive_piece(source, group=group, into=spare)) is not None:
                    kept, spare = self._keep(index, *received)
                    del received
                    if not kept:  # a late arrival after close() is not used
                        break
            except BaseException as exc:  # a source gone: the copies so far stay
                future.set_result(exc.with_traceback(None))  # its frames held the buffers
                return
            future.set_result(None)

        threading.Thread(target=run, name=f"peer-copies-from-{source}", daemon=True).start()
        return future

    def _keep(self, index: int, step: int, piece: Piece, meta: dict[str, Any],
              payload: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """Keep a copy of piece ``index`` that arrived whole (the two newest, unless
        closed: then False); and the buffer of the one it pushed out, to receive into next."""
        with self._lock:
            if self._closed:
                return False, None
            kept = self._held[index]
            kept[:] = [*kept[-(_KEPT - 1):], Snapshot(step, self._ring.count, index, piece, meta)]
            payloads = self._payloads.setdefault(index, [])
            payloads.append(payload)  # the kept copies' buffers, oldest first
            self._lock.notify_all()
            return True, payloads.pop(0) if len(payloads) > _KEPT else None


def send_piece(header: bytes | None, payload: torch.Tensor | None, *, to: int,
               group: dist.ProcessGroup) -> None:
    """Send a packed piece to rank ``to``: sizes, a small pickled header (step, structure,
    runtime state; between our own processes), then the tensors as the one byte buffer
    :meth:`PeerCopies.refresh` packed. With None, the end mark (sizes of -1). Blocking.

    Raises:
        RuntimeError: the peer is gone, or the group's timeout passed.
    """
    if header is None or payload is None:
        _point_to_point(torch.tensor([-1, -1], dtype=torch.int64), to=to, group=group)
        return
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    _point_to_point(torch.tensor([head.numel(), payload.numel()], dtype=torch.int64), to=to,
                    group=group)
    _point_to_point(head, to=to, group=group)
    _point_to_point(payload, to=to, group=group)


def receive_piece(source: int, *, group: dist.ProcessGroup, into: torch.Tensor | None = None
                  ) -> tuple[int, Piece, dict[str, Any], torch.Tensor] | None:
    """The next piece ``source`` sends (its step, the piece as views into one buffer, its
    runtime state, that buffer), or None at its end mark. Blocking.

    ``into``: a buffer no snapshot uses any more, received into when the sizes match. A
    fresh one of hundreds of MB is new pages each time (above glibc's mmap threshold):
    their faults and zeroing cost as much as the copy's memory traffic, on every step.

    Raises:
        RuntimeError: the peer is gone, or the group's timeout passed.
    """
    sizes = torch.empty(2, dtype=torch.int64)
    _point_to_point(sizes, source=source, group=group)
    if int(sizes[0]) < 0:
        return None
    head = torch.empty(int(sizes[0]), dtype=torch.uint8)
    payload = into if into is not None and into.numel() == int(sizes[1]) else \
        torch.empty(int(sizes[1]), dtype=torch.uint8)
    _point_to_point(head, source=source, group=group)
    _point_to_point(payload, source=source, group=group)
    step, skeleton, meta = pickle.loads(head.numpy().tobytes())
    return step, join_tensors(skeleton, _views(skeleton, payload)), meta, payload


def _point_to_point(tensor: torch.Tensor, *, group: dist.ProcessGroup, to: int | None = None,
                    source: int | None = None) -> None:
    work = (dist.isend(tensor, group=group, group_dst=to) if to is not None
            else dist.irecv(tensor, group=group, group_src=source))
    assert work is not None
    work.wait()


def _payload_bytes(piece: Piece) -> int:
    """The bytes of a piece's tensors (views into one packed buffer)."""
    _, tensors = split_tensors(piece)
    return sum(t.numel() * t.element_size() for t in tensors)


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
