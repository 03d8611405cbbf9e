"""A replica's tensors to the ranks that lack them, and to no other rank.

Rule: one all-gather of (step, fingerprint) per rank decides; holders never change, and only
receivers get anything, point to point, in chunks of at most 64 MB striped over the holders
by bytes::

    agree(step, fingerprint)   -> holders: the newest step, with the lowest such rank's print
                                  receivers: every other rank (a newcomer at -1, one behind)
    no receivers               -> nothing moves: 0 bytes (a node kill in data parallelism)
    else transfer(tensors)     -> each chunk from the least-loaded holder to every receiver,
                                  into the receiver's own tensors; Stream runs it beside
                                  training, over TCP connections of its own for host
                                  tensors (``tcp_stream.py``), else the group's backend

After a node kill every survivor finished the same last step (a step completes only once
its gradient all-reduce has seen every rank's share), so all are holders and the restore
costs one collective of 16 bytes per rank. A receiver has built its model and optimizer
before the transfer, so each tensor already exists with its final shape and a contiguous
one is received in place: no staging copy, nothing pickled. A non-contiguous tensor goes
through one staging copy of its own size (the only extra memory; none for a plain model
and optimizer). The order of the tensors is the caller's and must be one every rank
computes alike (``replica_state.py``).

Every wait goes through the round's abort notice (``worker/abort.py``), so a holder lost
mid-transfer ends it at once (point-to-point works have no future in gloo: one thread per
transfer waits on them in order and completes one, :class:`_Waiter`). A receiver whose
transfer broke holds nothing (its caller marks it dirty): in the next round it is a
receiver again. A receive it posted may still complete later: a holder cut off from the
network (or SIGSTOPped) with its sends in flight delivers them once it is reachable
again, seconds later, when the receiver has long received the state again and trained on
(a soak saw it: one chunk of step 447 landed in a newcomer's weights at step 451). So a
broken receive gives up the memory it was posted into: each tensor with a receive still
open gets fresh memory (its contents are void anyway), and the late bytes land in the
old memory, which only the abandoned receive still holds.

Note: the fingerprint reads a strided sample (1024 elements a tensor, every element of a
smaller one), so it tells states apart that differ anywhere a training step touches; it
does not prove two states equal bit for bit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import xxhash
from torch.futures import Future

from elastic_rt.worker import abort
from elastic_rt.worker.trainers.tcp_stream import Links, open_links

CHUNK_BYTES = 64 << 20
"""The most bytes one message carries: large enough for wire speed, small enough to
overlap sending one with receiving the next."""
WINDOW = 4
"""Messages a rank keeps outstanding before it waits for the oldest."""
_SAMPLE = 1024
"""Elements of each tensor the fingerprint reads."""

_Pending = tuple[Future[None], torch.Tensor, Callable[[], None] | None]
"""A posted message, the piece it reads or writes, and what to do once it is done."""


@dataclass(frozen=True, slots=True)
class Agreement:
    """Who holds the newest state and who must receive it (ranks of the group)."""

    step: int
    """The newest step any rank holds; -1 when none holds state."""
    holders: tuple[int, ...]
    receivers: tuple[int, ...]

    @property
    def is_settled(self) -> bool:
        """Whether every rank already holds the state (nothing to move)."""
        return not self.receivers


def plan(standings: list[tuple[int, int]]) -> Agreement:
    """Pure: holders and receivers from every rank's (step, fingerprint), by rank.

    The lowest rank at the newest step sets the fingerprint; a rank at that step with
    another one receives (its state is not the one the others continue from). When no rank
    holds state (every step is -1) there are no holders and no receivers: the caller falls
    back to the checkpoint.
    """
    best = max(step for step, _ in standings)
    if best < 0:
        return Agreement(step=-1, holders=(), receivers=())
    reference = next(print_ for step, print_ in standings if step == best)
    holders = tuple(r for r, s in enumerate(standings) if s == (best, reference))
    receivers = tuple(r for r in range(len(standings)) if r not in holders)
    return Agreement(step=best, holders=holders, receivers=receivers)


def agree(step: int, print_: int, group: dist.ProcessGroup) -> Agreement:
    """:func:`plan` over every rank of ``group``: one all-gather of two integers each.

    Raises:
        RoundAbandoned: a newer round dropped a member while this waited.
        RuntimeError: a peer's connection failed.
    """
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    mine = torch.tensor([step, print_], dtype=torch.int64)
    _wait(dist.all_gather(gathered, mine, group=group, async_op=True))
    return plan([(int(t[0]), int(t[1])) for t in gathered])


def fingerprint(tensors: list[torch.Tensor]) -> int:
    """A 63-bit digest of the tensors' shapes, dtypes and a strided sample of their values.

    Equal states always agree. Costs one small gather per tensor and one host copy per
    device: 1-2 ms for the 32 tensors of 400 MB of AdamW state.
    """
    digest = xxhash.xxh3_64()
    samples: dict[torch.device, list[torch.Tensor]] = {}  # one host copy per device
    for tensor in tensors:
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype};".encode())
        n = tensor.numel()
        if n:
            index = torch.arange(0, n, max(1, n // _SAMPLE), device=tensor.device)
            sample = torch.take(tensor.detach(), index).view(torch.uint8)
            samples.setdefault(tensor.device, []).append(sample)
    for on_device in samples.values():
        digest.update(torch.cat(on_device).cpu().numpy().tobytes())
    return digest.intdigest() >> 1  # fits an int64


def chunks(sizes: list[int], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int, int]]:
    """Pure: (tensor index, first byte, end byte) of every message, for tensors of ``sizes``
    bytes; every rank computes the same list from the same sizes."""
    return [(index, start, min(start + chunk_bytes, size))
            for index, size in enumerate(sizes) for start in range(0, size, chunk_bytes)]


def senders(pieces: list[tuple[int, int, int]], holders: tuple[int, ...]) -> list[int]:
    """Pure: the holder that sends each of ``pieces`` (from :func:`chunks`), so that every
    holder sends about the same number of bytes: each piece goes to the holder that has the
    fewest so far (the lowest rank on a tie). By count (piece i to holder i mod H) a model
    of weights and small biases would put every weight on the same holder."""
    load = dict.fromkeys(holders, 0)
    chosen = []
    for _, start, end in pieces:
        holder = min(holders, key=lambda h: (load[h], h))
        load[holder] += end - start
        chosen.append(holder)
    return chosen


def planned_bytes(sizes: list[int], agreement: Agreement, rank: int, *,
                  chunk_bytes: int = CHUNK_BYTES) -> int:
    """Pure: the bytes ``rank`` sends or receives when tensors of ``sizes`` bytes go from
    the holders to the receivers (each receiver gets every byte once; each chunk leaves its
    sender, :func:`senders`, once per receiver)."""
    if agreement.is_settled:
        return 0
    pieces = chunks(sizes, chunk_bytes)
    if rank in agreement.receivers:
        return sum(end - start for _, start, end in pieces)
    if rank not in agreement.holders:
        return 0
    mine = [end - start for (_, start, end), sender
            in zip(pieces, senders(pieces, agreement.holders)) if sender == rank]
    return sum(mine) * len(agreement.receivers)


class Stream:
    """A transfer running beside the training thread: started at once, finished later.

    A join streams the holders' state to a newcomer while the holders train the next step:
    the holders' forward and backward only read the tensors being sent, and the step calls
    :meth:`finish` before its update writes them (``replicated.py``). The posting runs in a
    thread of its own; its waits go through the abort notice like every other wait. Host
    tensors go over the stream's own TCP connections (``tcp_stream.open_links``, one small
    all-gather here: collective over ``group``), the rest through the group's backend.

    Args:
        tensors, agreement, group, chunk_bytes: as for :func:`transfer`.
    """

    def __init__(self, tensors: list[torch.Tensor], agreement: Agreement,
                 group: dist.ProcessGroup, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        me = dist.get_rank(group)
        self.bytes = planned_bytes([t.numel() * t.element_size() for t in tensors], agreement,
                                   me, chunk_bytes=chunk_bytes)
        self._links = open_links(host_only=all(t.device.type == "cpu" for t in tensors),
                                 is_holder=me in agreement.holders, group=group)
        self.began = time.monotonic()
        self.seconds: float | None = None
        """How long the transfer took, once :meth:`finish` returned."""
        self.wire_seconds: float | None = None
        """From the start to the last byte sent or received (set by the stream's thread):
        the stream's own speed, where :attr:`seconds` also holds the training it hid in."""
        self._done: Future[int] = Future()
        self._wires = _Wires(tensors, me in agreement.receivers)
        self._thread = threading.Thread(
            target=self._run, args=(agreement, group, chunk_bytes),
            name="replica-stream", daemon=True)
        self._thread.start()

    def give_up(self) -> None:
        """The stream broke off (its round is gone): it posts nothing more, and a receiver's
        receives still open can no longer write the state (:meth:`_Wires.give_up`; over
        TCP its sockets are shut and its threads joined). Call it before the tensors are
        used again, e.g. by the next round's restore."""
        if self._links is not None:
            self._links.close()
        self._wires.give_up()

    def finish(self) -> int:
        """Wait for the last byte; the bytes this rank sent or received.

        Raises:
            RoundAbandoned: a newer round dropped a member while the transfer waited.
            RuntimeError: a peer's connection failed.
        """
        moved = abort.wait(self._done)
        if self.seconds is None:
            self.seconds = time.monotonic() - self.began
        return moved

    def _run(self, agreement: Agreement, group: dist.ProcessGroup, chunk_bytes: int) -> None:
        try:
            if self._links is None:
                moved = _transfer(self._wires, agreement, group, chunk_bytes)
            else:
                moved = _transfer_tcp(self._links, self._wires, agreement, chunk_bytes)
            self.wire_seconds = time.monotonic() - self.began
            self._done.set_result(moved)
        except Exception as exc:  # a thread boundary: finish() raises it
            self._done.set_exception(exc)  # type: ignore[arg-type]  # torch types it as T
        finally:
            if self._links is not None:
                self._links.close()


def transfer(tensors: list[torch.Tensor], agreement: Agreement, group: dist.ProcessGroup, *,
             chunk_bytes: int = CHUNK_BYTES) -> int:
    """Send the holders' ``tensors`` into the receivers' ``tensors``; the bytes this rank
    sent or received.

    Every rank passes its own tensors in the same order, of the same shapes and dtypes
    (a receiver's are overwritten, a holder's only read).

    Raises:
        RoundAbandoned: a newer round dropped a member while the transfer waited.
        RuntimeError: a peer's connection failed.
    """
    wires = _Wires(tensors, dist.get_rank(group) in agreement.receivers)
    try:
        return _transfer(wires, agreement, group, chunk_bytes)
    except BaseException:
        wires.give_up()
        raise


def _transfer_tcp(links: Links, wires: _Wires, agreement: Agreement, chunk_bytes: int) -> int:
    """:func:`_transfer` over the stream's own sockets (``tcp_stream.py``)."""
    def bytes_of(index: int) -> torch.Tensor:
        with wires.posting(index) as piece_of:
            return piece_of
    pieces = chunks(wires.sizes, chunk_bytes)
    return links.transfer(pieces, senders(pieces, agreement.holders), agreement.receivers,
                          bytes_of, wires.on_received)


def _transfer(wires: _Wires, agreement: Agreement, group: dist.ProcessGroup,
              chunk_bytes: int) -> int:
    me = dist.get_rank(group)
    is_receiver = wires.is_receiver
    if agreement.is_settled or not (is_receiver or me in agreement.holders):
        return 0
    waiter = _Waiter()
    # each entry keeps its piece alive: a staged piece's copy may already be out of _Wires
    pending: deque[_Pending] = deque()
    moved = 0
    try:
        pieces = chunks(wires.sizes, chunk_bytes)
        for number, ((index, start, end), sender) in enumerate(
                zip(pieces, senders(pieces, agreement.holders))):
            if not (is_receiver or me == sender):
                continue
            with wires.posting(index) as piece_of:  # one post at a time against give_up
                piece = piece_of[start:end]
                if is_receiver:
                    works = [dist.irecv(piece, group_src=sender, group=group, tag=number)]
                else:
                    works = [dist.isend(piece, group_dst=dst, group=group, tag=number)
                             for dst in agreement.receivers]
                posted = [waiter.post(work) for work in works]
                if is_receiver:
                    wires.open_receives[index].extend(posted)
            last = wires.on_received(index) if is_receiver and end == wires.sizes[index] else None
            pending.extend((done, piece, None) for done in posted[:-1])
            pending.append((posted[-1], piece, last))
            moved += (end - start) * len(works)
            while len(pending) > WINDOW:
                _finish(pending.popleft())
        while pending:
            _finish(pending.popleft())
    finally:
        waiter.close()
    return moved


class _Wires:
    """Each tensor as one flat run of bytes: its own memory when contiguous, else a staging
    copy (filled from the tensor on a holder, copied into it on a receiver)."""

    def __init__(self, tensors: list[torch.Tensor], is_receiver: bool) -> None:
        self.tensors, self.is_receiver = tensors, is_receiver
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.staged: dict[int, torch.Tensor] = {}
        self.open_receives: defaultdict[int, list[Future[None]]] = defaultdict(list)
        """By tensor, the receives posted into it (a done one may be left here)."""
        self._lock = threading.Lock()
        self._given_up = False

    @contextmanager
    def posting(self, index: int) -> Iterator[torch.Tensor]:
        """Tensor ``index``'s bytes, to post one message on, unless the transfer was given
        up (then it raises): a post and :meth:`give_up` never overlap.

        Raises:
            RuntimeError: the transfer was given up.
        """
        with self._lock:
            if self._given_up:
                raise RuntimeError("the state transfer was given up (its round is gone)")
            yield self.bytes_of(index)

    def give_up(self) -> None:
        """No more posts; and on a receiver, each tensor whose own memory a receive still
        open was posted into moves to fresh memory (its contents are void anyway), so the
        receive can only write the old memory, which it alone still holds (a staged
        tensor's receive writes its staging copy, which nothing reads any more). Once."""
        with self._lock, torch.no_grad():
            if self._given_up:
                return
            self._given_up = True
            for index, receives in self.open_receives.items():
                if index in self.staged or all(done.done() for done in receives):
                    continue
                tensor = self.tensors[index]
                fresh = torch.empty_like(tensor)
                tensor.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())

    def bytes_of(self, index: int) -> torch.Tensor:
        tensor = self.tensors[index].detach()
        if tensor.is_contiguous():
            return tensor.view(-1).view(torch.uint8)
        if index not in self.staged:
            if self.is_receiver:
                self.staged[index] = torch.empty_like(tensor,
                                                      memory_format=torch.contiguous_format)
            else:  # a holder's copies of earlier tensors live on in their pending sends only
                self.staged = {index: tensor.contiguous()}
        return self.staged[index].view(-1).view(torch.uint8)

    def on_received(self, index: int) -> Callable[[], None]:
        """What to do once the tensor's last chunk arrived (the earlier ones did before)."""
        def landed() -> None:
            if index in self.staged:
                with self._lock, torch.no_grad():
                    staged = self.staged.pop(index)
                    if not self._given_up:  # else its bytes may be late ones of a round gone
                        self.tensors[index].copy_(staged)
        return landed


class _Waiter:
    """Waits on point-to-point works in a thread of its own, in the order they were posted.

    gloo's send and receive works have no future (``get_future`` raises), ``is_completed``
    stays False until someone waits, and a ``wait`` that times out fails every pair of the
    group; so one daemon thread waits and completes a future the abort notice can race. A
    thread left waiting by an abandoned round (a hung peer) is blocked outside Python and
    ends with the process.
    """

    def __init__(self) -> None:
        self.works: queue.SimpleQueue[tuple[dist.Work | None, Future[None]] | None] = \
            queue.SimpleQueue()
        threading.Thread(target=self._run, name="replica-transfer", daemon=True).start()

    def post(self, work: dist.Work | None) -> Future[None]:
        done: Future[None] = Future()
        self.works.put((work, done))
        return done

    def close(self) -> None:
        self.works.put(None)

    def _run(self) -> None:
        while (item := self.works.get()) is not None:
            work, done = item
            try:
                assert work is not None  # isend and irecv always return a Work
                work.wait()
                done.set_result(None)
            except Exception as exc:  # a thread boundary: the training thread raises it
                done.set_exception(exc)  # type: ignore[arg-type]  # torch types it as T


def _finish(entry: _Pending) -> None:
    done, _, then = entry
    abort.wait(done)
    if then is not None:
        then()


def _wait(work: dist.Work | None) -> None:
    assert work is not None  # async_op=True always returns a Work
    abort.wait(work.get_future())
