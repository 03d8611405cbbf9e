"""Local checkpoint files read straight into the model's tensors, every byte hashed.

A restore from local disk runs at the disk's speed with almost no memory beyond the
state: the bytes of each tensor item are read (``preadv``) directly into its target
tensor (DCP's planner resolves it), with no buffer and no mapping between. Two reader
threads (``READERS``) take the file's pieces in turn; each hashes the piece it read,
still in its core's cache, once every piece before it is hashed, so the checksum is
the file's, in order. Size and checksum are checked against the manifest at the end.

Measured on this project's 2-core machine (shared, so cold figures vary with the
other users of the disk), a 1.21 GB AdamW state (24 x Linear(2048, 2048), one file)
restored through the runtime's call, against 16 MiB sequential reads of the same file
into one reused buffer, medians of 5 (``scripts/bench/checkpoint.py --only-restore``)::

                              cold (drop_caches)   warm (page cache)    peak extra RSS
    file mapped, hashed, copied  0.76 of raw read  0.68 (5.6/8.2 GB/s)  1209 MB
    read into the tensors        0.9-1.9 of raw    0.65 (4.4/6.8 GB/s)  1 MB

Mapping the file (the way before) made every page of it resident in the process
during the load (the 1209 MB) and touched each byte twice: the hash, then the copy.
DCP's own ``FileSystemReader`` does not read into the destination either: it
``torch.load``-s each item into a fresh tensor and copies that.

Note:
    Warm, the raw baseline writes into a 16 MiB buffer that stays in the cache; a
    restore must write 1.2 GB into memory. One ``readinto`` of the file into a 1.2 GB
    tensor, without hashing, already takes 0.186 s against the baseline's 0.130 s
    (0.70); two readers take 0.096 s, and with the hash 0.16 s. The rest is the
    items' Python work on the caller's thread (~0.04 s for 200 items), which also
    makes the readers wait for the GIL.

An item is read into its target when the bytes map onto it one to one: a tensor item
of at least ``DIRECT_MIN_BYTES`` whose target is a contiguous CPU tensor of the saved
dtype, and whose wanted part of the saved chunk is contiguous (the whole chunk, or
rows of it: the same layout, or a reshard along the first dim). Its record's small
parts (zip directory, ``data.pkl``) are read first through a second handle, so the
stream's readahead stays sequential. Any other item (small, a column reshard, a GPU
target, another dtype, not a plain tensor) is read into a buffer of its own size and
decoded there by the caller's ``load`` (:mod:`.tensor_file`, never pickle).

Note:
    The check comes after the bytes, as on an object store: a damaged file has been
    partly copied into the model by the time it fails its check. The load then fails
    with :class:`CorruptShardError`, and the caller's fallback load overwrites what
    it copied; a load that fails for every candidate leaves the state partly written.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from elastic_rt.checkpoint.checksum import Hasher, hasher_like
from elastic_rt.checkpoint.manifest import FileEntry
from elastic_rt.checkpoint.storage import NOT_A_FILE
from elastic_rt.checkpoint.tensor_file import TensorRecord, locate
from elastic_rt.errors import CorruptShardError

READERS = 2
"""Threads reading one file at once. Two cores copy from the page cache faster than one
(1.21 GB into a model's tensors, warm: 0.186 s with one reader, 0.096 s with two; one
16 MiB read buffer reused: 0.130 s), and the disk sees two requests in flight."""

CHUNK_BYTES = 4 << 20
"""One read: small enough that its reader hashes it from its own core's cache."""

DIRECT_MIN_BYTES = 1 << 20
"""Smaller items are read into a buffer: one read, no look at their record first."""

PROBE_BYTES = 4096
"""How much of a record's head and tail is read to find its tensor's bytes."""

PENDING_PIECES = 16
"""Pieces submitted but not taken by a reader yet; with the readers' own, what bounds
the buffers of bytes no tensor wants (``(PENDING_PIECES + READERS) * CHUNK_BYTES``)."""

Item = tuple[ReadItem, int, int]
"""(item, offset, length) in the file."""

LoadBuffered = Callable[[ReadItem, memoryview], None]
"""Decodes an item read into a buffer and copies it into its target; raises
CorruptShardError to refuse it."""


def check_file(source: str, expected: FileEntry, size: int, checksum: str | None) -> None:
    """Raise CorruptShardError unless ``size`` (and ``checksum``, if given) match the
    manifest's."""
    if size == expected.size and checksum in (None, expected.checksum):
        return
    found = f"{size} bytes" + (f" with checksum {checksum}" if checksum else "")
    wanted = f"{expected.size} bytes" + (f" with {expected.checksum}" if checksum else "")
    raise CorruptShardError(f"{source} fails its check: {found}, the manifest says {wanted}")


def read_local_file(path: str, source: str, expected: FileEntry, items: list[Item],
                    planner: LoadPlanner, load: LoadBuffered) -> CorruptShardError | None:
    """Read one local file for ``dcp.load``: every item into its target, every byte hashed.

    Args:
        items: what DCP wants from the file, sorted by offset, not overlapping.

    Returns:
        The first item refused (not a plain tensor, or not of its target's shape): the
        caller reports it once every file has passed its check, which a damaged file fails.

    Raises:
        CorruptShardError: the file is missing or fails its size or checksum check.
    """
    try:
        handle = open(path, "rb", buffering=0)
    except NOT_A_FILE:
        raise CorruptShardError(f"{source} is missing or not a file") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        check_file(source, expected, size, None)
        reads = _Reads(handle.fileno(), hasher_like(expected.checksum), source)
        walk = _Walk(reads, handle.fileno(), planner, load)
        try:
            walk.read_items(items)
            walk.skip_to(size)
            walk.finish()
        finally:
            checksum = reads.close()
    check_file(source, expected, walk.pos, checksum)
    walk.commit()
    return walk.refusal


class _Reads:
    """Pieces of one file read by ``READERS`` threads at once and hashed in file order.

    Each reader hashes the piece it read (still in its core's cache) as soon as every
    piece before it is hashed, so the two cores share both the copying and the hashing.
    """

    def __init__(self, fd: int, hasher: Hasher, source: str) -> None:
        self._fd = fd
        self._hasher = hasher
        self._source = source
        self._todo: queue.Queue[tuple[int, int, memoryview] | None] = queue.Queue(
            maxsize=PENDING_PIECES)
        self._submitted = 0
        self._hashed = 0
        """Pieces hashed so far: the next piece's turn."""
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._readers = [threading.Thread(target=self._work, name="ckpt-read", daemon=True)
                         for _ in range(READERS)]
        for reader in self._readers:
            reader.start()

    def submit(self, offset: int, view: memoryview) -> int:
        """Read ``view``'s length of bytes at ``offset`` into it; the index of its last piece."""
        for start in range(0, len(view), CHUNK_BYTES):
            self._raise_failure()
            self._todo.put((self._submitted, offset + start, view[start:start + CHUNK_BYTES]))
            self._submitted += 1
        return self._submitted - 1

    def is_done(self, index: int) -> bool:
        self._raise_failure()
        return self._hashed > index

    def wait(self, index: int) -> None:
        """Until piece ``index`` is read (and hashed)."""
        with self._changed:
            self._changed.wait_for(lambda: self._hashed > index or self._error is not None)
        self._raise_failure()

    def close(self) -> str:
        """Wait for every reader; the checksum of everything submitted."""
        for _ in self._readers:
            self._todo.put(None)
        for reader in self._readers:
            reader.join()
        self._raise_failure()
        return self._hasher.value()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while (job := self._todo.get()) is not None:
            index, offset, view = job
            try:
                if self._error is None:
                    self._read(offset, view)
            except BaseException as exc:  # thread boundary: the caller's next call raises it
                self._fail(exc)
            with self._changed:
                self._changed.wait_for(lambda: self._hashed == index or self._error is not None)
                if self._error is None:
                    self._hasher.update(view)
                self._hashed += 1
                self._changed.notify_all()

    def _read(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if not count:  # the file got shorter under us
                raise CorruptShardError(f"{self._source} fails its check: it ends at "
                                        f"{offset + done} bytes")
            done += count

    def _fail(self, exc: BaseException) -> None:
        with self._changed:
            if self._error is None:
                self._error = exc
            self._changed.notify_all()


class _Walk:
    """The caller's side: where each byte of the file goes, item by item."""

    def __init__(self, reads: _Reads, probe: int, planner: LoadPlanner,
                 load: LoadBuffered) -> None:
        self._reads = reads
        self._probe = probe
        self._planner = planner
        self._load = load
        self.pos = 0
        self.refusal: CorruptShardError | None = None
        self._buffered: collections.deque[tuple[int, ReadItem, memoryview]] = (
            collections.deque())
        self._direct: list[tuple[ReadItem, torch.Tensor]] = []

    def read_items(self, items: list[Item]) -> None:
        for item, offset, length in items:
            if offset < self.pos:
                raise CorruptShardError("items overlap")  # metadata_check refuses these first
            self.skip_to(offset)
            direct = None if self.refusal else self._direct_target(item, offset, length)
            if direct is not None:
                start, target = direct
                self.skip_to(offset + start)
                self._submit(_writable_bytes(target))
                self._direct.append((item, target))
            elif self.refusal is None:
                buffer = memoryview(bytearray(length))
                self._buffered.append((self._submit(buffer), item, buffer))
            self.skip_to(offset + length)
            self._load_buffered(wait=False)

    def skip_to(self, end: int) -> None:
        """Read (and hash) the bytes up to ``end`` that no tensor wants."""
        while self.pos < end:
            self._submit(memoryview(bytearray(min(CHUNK_BYTES, end - self.pos))))

    def finish(self) -> None:
        """Once every byte is submitted: load what was read into buffers."""
        self._load_buffered(wait=True)

    def commit(self) -> None:
        """Once every read is done: tell the planner about the tensors read in place."""
        if self.refusal is None:
            for item, target in self._direct:
                self._planner.commit_tensor(item, target)

    def _submit(self, view: memoryview) -> int:
        index = self._reads.submit(self.pos, view)
        self.pos += len(view)
        return index

    def _load_buffered(self, *, wait: bool) -> None:
        while self._buffered:
            last, item, buffer = self._buffered[0]
            if wait:
                self._reads.wait(last)
            elif not self._reads.is_done(last):
                return
            self._buffered.popleft()
            if self.refusal is None:
                try:
                    self._load(item, buffer)
                except CorruptShardError as exc:
                    self.refusal = exc

    def _direct_target(self, item: ReadItem, offset: int,
                       length: int) -> tuple[int, torch.Tensor] | None:
        """(where in the record the target's bytes start, the target) when the item's
        bytes can be read straight into its target (see the module docstring), else None."""
        if item.type != LoadItemType.TENSOR or length < DIRECT_MIN_BYTES:
            return None
        edge = min(PROBE_BYTES, length)
        head = memoryview(os.pread(self._probe, edge, offset))
        tail = memoryview(os.pread(self._probe, edge, offset + length - edge))

        def read(start: int, size: int) -> memoryview:
            if 0 <= start and start + size <= len(head):
                return head[start:start + size]
            if start >= length - len(tail) and start + size <= length:
                return tail[start - (length - len(tail)):][:size]
            raise IndexError("not in the record's head or tail")

        found = locate(read, length)
        if found is None:
            return None
        target = self._planner.resolve_tensor(item).detach()
        start = _contiguous_start(found, tuple(item.storage_offsets), tuple(item.lengths))
        if (start is None or target.device.type != "cpu" or target.dtype != found.dtype
                or tuple(target.shape) != tuple(item.lengths) or not target.is_contiguous()
                or target.is_conj() or target.is_neg()):
            return None
        return start, target


def _contiguous_start(found: TensorRecord, offsets: tuple[int, ...],
                      lengths: tuple[int, ...]) -> int | None:
    """Where in the record the part ``offsets``/``lengths`` of the saved chunk starts,
    when that part is one contiguous run of bytes there; else None."""
    if len(offsets) != len(found.size) or len(lengths) != len(found.size) or any(
            o < 0 or n < 1 or o + n > s for o, n, s in zip(offsets, lengths, found.size)):
        return None
    part = torch.empty_strided(lengths, found.stride, dtype=found.dtype, device="meta")
    if not part.is_contiguous():
        return None
    first = found.offset + sum(o * s for o, s in zip(offsets, found.stride))
    if first < 0 or first + math.prod(lengths) > found.numel:
        return None
    return found.start + first * found.dtype.itemsize


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)
