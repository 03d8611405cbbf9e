"""DCP's storage reader for our checkpoints: verified, pipelined, and without pickle.

DCP hands the reader a load plan: which byte ranges of which files go into which
tensors. We read every file it touches front to back exactly once, hashing every
byte and checking size and checksum against the manifest, so damage anywhere in a
file is caught even when only part of it is needed (see the note for when).

* A local file is read straight into the model's tensors by two threads, which hash
  each piece as it lands (:mod:`.local_read`: at the disk's speed cold, ~1 MB of
  memory beyond the state); one file after another, so the disk sees one stream.
* An object store gets one reader thread per file DCP wrote per rank (the caller's
  thread decodes the items that arrived and copies them in meanwhile), because one S3
  stream is slow and several in parallel are how S3 reaches its throughput. Each
  file is fetched in ranged GETs of whole runs of items (no HEAD: one listing of
  the folder has every size; no file object and its cache copies), and items are
  views of the fetched bytes. At most ``BUFFER_BUDGET`` bytes wait to be copied in.

Tensor items are decoded in place (:mod:`.tensor_file`); pickled (``BYTE_IO``)
items are refused.

Note:
    A file's size is checked before it is read (an object's from one listing of the
    folder, as ``verify`` sees it), but its checksum only once its bytes are read: a
    failed check comes after some of its items were copied in. The load then fails
    and the caller's fallback load overwrites them. (A local file used to be checked
    whole before its items were copied, from a mapping of the whole file: 1.2 GB of
    resident memory for a 1.2 GB state, see :mod:`.local_read`.)
"""

from __future__ import annotations

import io
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from elastic_rt.checkpoint.checksum import Hasher, hasher_like
from elastic_rt.checkpoint.local_read import check_file, read_local_file
from elastic_rt.checkpoint.manifest import FileEntry, Manifest
from elastic_rt.checkpoint.storage import (
    NOT_A_FILE,
    FsspecStorage,
    call_with_retries,
    translate_error,
)
from elastic_rt.checkpoint.tensor_file import decode_in_place
from elastic_rt.errors import CorruptShardError

logger = logging.getLogger(__name__)

BUFFER_BUDGET = 512 << 20
"""Bytes an object-store load holds fetched but not yet copied into the model."""

SEGMENT_BYTES = 64 << 20
"""Largest ranged GET of adjacent items (a single larger item is fetched whole)."""

OBJECT_STORE_READERS = 4
"""Files read at once from an object store (matches the files each rank writes)."""


@dataclass
class _FileJob:
    """One file to read, with the items wanted from it in file order."""

    rel: str
    path: str
    source: str
    expected: FileEntry
    items: list[tuple[ReadItem, int, int]] = field(default_factory=list)
    """(item, offset, length), sorted by offset."""


class _Cancelled(Exception):
    """The load stopped; readers drop what they were doing."""


class _ByteBudget:
    """Bytes fetched but not yet consumed; a reader waits while the budget is spent.

    A single request larger than the whole budget is let through when nothing else
    is held, so one huge item cannot stall the load.
    """

    def __init__(self, limit: int, cancel: threading.Event) -> None:
        self._limit = limit
        self._held = 0
        self._changed = threading.Condition()
        self._cancel = cancel

    def take(self, nbytes: int) -> None:
        with self._changed:
            while self._held and self._held + nbytes > self._limit:
                if self._cancel.is_set():
                    raise _Cancelled()
                self._changed.wait(timeout=0.1)  # re-check cancellation
            self._held += nbytes

    def give(self, nbytes: int) -> None:
        with self._changed:
            self._held -= nbytes
            self._changed.notify_all()


class VerifyingReader(FsspecReader):
    """Reads one checkpoint for ``dcp.load`` (see the module docstring)."""

    def __init__(self, storage: FsspecStorage, manifest: Manifest, metadata: Metadata,
                 sizes: dict[str, int] | None) -> None:
        super().__init__(storage.url_of(manifest.name), **storage.storage_options)
        self._storage = storage
        self.path = storage.path(manifest.name)
        self._url = storage.url_of(manifest.name)
        self._metadata = metadata
        self._expected = {f.path: f for f in manifest.files}
        self._sizes = sizes

    def read_metadata(self) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        jobs = self._jobs(plan)
        if self._storage.is_local:
            _read_local(jobs, planner)
        elif jobs:
            _Pipeline(self._storage, jobs, min(OBJECT_STORE_READERS, len(jobs)),
                      self._sizes).run(
                lambda job, item, data: _load_item(item, data, planner, job.source))
        future: TorchFuture[None] = TorchFuture()
        future.set_result(None)
        return future

    def _jobs(self, plan: LoadPlan) -> list[_FileJob]:
        jobs: dict[str, _FileJob] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            rel = info.relative_path
            job = jobs.get(rel)
            if job is None:
                expected = self._expected.get(rel)
                if expected is None:
                    raise CorruptShardError(f"{self._url}/{rel} is not listed in the manifest")
                job = jobs[rel] = _FileJob(rel, f"{self.path}/{rel}", f"{self._url}/{rel}",
                                           expected)
            job.items.append((item, info.offset, info.length))
        for job in jobs.values():
            job.items.sort(key=lambda entry: entry[1])
        return sorted(jobs.values(), key=lambda j: j.rel)


def _read_local(jobs: list[_FileJob], planner: LoadPlanner) -> None:
    """Local files, one after another (one sequential stream): :mod:`.local_read`."""
    refusals = []
    for job in jobs:
        def load(item: ReadItem, data: memoryview, source: str = job.source) -> None:
            _load_item(item, data, planner, source)

        refusal = read_local_file(job.path, job.source, job.expected, job.items, planner, load)
        if refusal is not None:
            refusals.append(refusal)
    if refusals:
        raise refusals[0]  # every file passed its check: the refusal is the fault


def _load_item(item: ReadItem, data: memoryview, planner: LoadPlanner, source: str) -> None:
    if item.type == LoadItemType.BYTE_IO:
        raise CorruptShardError(f"{source} holds a pickled object for {item.dest_index.fqn!r};"
                                " it was refused")
    tensor = decode_item(data, source, item.dest_index.fqn)
    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CorruptShardError(f"{source} has shape {tuple(tensor.size())} for "
                                f"{item.dest_index.fqn!r}, expected {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


class _Pipeline:
    """Reader threads feeding items to the caller's thread (see the module docstring)."""

    def __init__(self, storage: FsspecStorage, jobs: list[_FileJob], readers: int,
                 sizes: dict[str, int] | None) -> None:
        self._storage = storage
        self._sizes = sizes
        self._jobs = jobs
        self._readers = readers
        self._cancel = threading.Event()
        self._budget = _ByteBudget(BUFFER_BUDGET, self._cancel)
        self._arrivals: queue.Queue[tuple[Any, ...]] = queue.Queue()

    def run(self, consume: Callable[[_FileJob, ReadItem, memoryview], None]) -> None:
        """Read every job, calling ``consume`` for each item on this thread.

        Raises:
            CorruptShardError: a file is missing or fails its check (checked before an
                item's refusal, which a damaged file may explain), or an item was refused.
            CheckpointError: storage failed after retries.
        """
        failures: dict[str, BaseException] = {}
        refusals: dict[str, CorruptShardError] = {}
        with ThreadPoolExecutor(self._readers, thread_name_prefix="ckpt-read") as executor:
            for job in self._jobs:
                executor.submit(self._read_job, job)
            try:
                self._consume_all(consume, failures, refusals)
            finally:
                self._cancel.set()  # readers still running (only after a failure) stop
        for job in self._jobs:
            if job.rel in failures:
                raise failures[job.rel]
        for job in self._jobs:
            if job.rel in refusals:
                raise refusals[job.rel]

    def _consume_all(self, consume: Callable[[_FileJob, ReadItem, memoryview], None],
                     failures: dict[str, BaseException],
                     refusals: dict[str, CorruptShardError]) -> None:
        pending = len(self._jobs)
        while pending:
            kind, job, *rest = self._arrivals.get()
            if kind == "item":
                item, data, budgeted = rest
                try:
                    if not failures and job.rel not in refusals:
                        consume(job, item, data)
                except CorruptShardError as exc:
                    refusals[job.rel] = exc  # reported once the file's check is known
                finally:
                    self._budget.give(budgeted)
                continue
            pending -= 1
            if rest[0] is not None:
                failures[job.rel] = rest[0]
                return  # the load fails; do not wait for the other files

    # -- reader threads ---------------------------------------------------------------

    def _read_job(self, job: _FileJob) -> None:
        outcome: BaseException | None = None
        try:
            self._read_file(job)
        except _Cancelled:
            return
        except NOT_A_FILE:
            outcome = CorruptShardError(f"{job.source} is missing or not a file")
        except CorruptShardError as exc:
            outcome = exc
        except Exception as exc:  # the seam: storage errors of any client library
            outcome = self._explain(job, exc)
        self._arrivals.put(("checked", job, outcome))

    def _read_file(self, job: _FileJob) -> None:
        hasher = hasher_like(job.expected.checksum)
        listed = job.expected.size if self._sizes is None else self._sizes.get(job.rel)
        if listed is None:
            raise CorruptShardError(f"{job.source} is missing or not a file")
        check_file(job.source, job.expected, listed, None)
        check_file(job.source, job.expected, self._read_streamed(job, hasher), hasher.value())

    def _read_streamed(self, job: _FileJob, hasher: Hasher) -> int:
        """An object is fetched in ranged GETs of whole items (no HEAD, no file object
        and its cache copies); items are views of the fetched bytes."""
        size = 0
        for segment in _segments(job.items):
            start, end = segment[0][1], segment[-1][1] + segment[-1][2]
            size = self._fetch_hashed(job, size, start, hasher)  # a gap DCP did not plan
            self._budget.take(end - start)
            data = memoryview(self._fetch(job, start, end))
            hasher.update(data)
            size += len(data)
            for item, offset, length in segment:
                if self._cancel.is_set():
                    raise _Cancelled()
                view = data[offset - start:offset - start + length]
                self._arrivals.put(("item", job, item, view, length))
            if len(data) < end - start:
                return size  # the object is short: its check says so
        return self._fetch_hashed(job, size, job.expected.size, hasher)

    def _fetch_hashed(self, job: _FileJob, size: int, until: int, hasher: Hasher) -> int:
        """Fetch and hash bytes no item needs, up to ``until``; the new size."""
        while size < until:
            data = self._fetch(job, size, min(until, size + SEGMENT_BYTES))
            if not data:
                break
            hasher.update(data)
            size += len(data)
        return size

    def _fetch(self, job: _FileJob, start: int, end: int) -> bytes:
        if self._cancel.is_set():
            raise _Cancelled()
        return call_with_retries(self._storage.fs.cat_file, job.path, start=start, end=end,
                                 url=self._storage.url)

    def _explain(self, job: _FileJob, exc: BaseException) -> BaseException:
        """An object opened with the manifest's size fails its reads when it is
        shorter: say so instead of reporting a storage error."""
        try:
            actual = self._storage.fs.size(job.path)
        except FileNotFoundError:
            return CorruptShardError(f"{job.source} is missing")
        except Exception:  # the storage is failing: report the original error
            return translate_error(exc, self._storage.url)
        if actual != job.expected.size:
            return CorruptShardError(f"{job.source} fails its check: {actual} bytes, the "
                                     f"manifest says {job.expected.size}")
        return translate_error(exc, self._storage.url)


def _segments(items: list[tuple[ReadItem, int, int]]) -> list[list[tuple[ReadItem, int, int]]]:
    """Runs of adjacent items, each run at most ``SEGMENT_BYTES`` (or one larger item)."""
    runs: list[list[tuple[ReadItem, int, int]]] = []
    for entry in items:
        last = runs[-1] if runs else None
        if (last is not None and last[-1][1] + last[-1][2] == entry[1]
                and entry[1] + entry[2] - last[0][1] <= SEGMENT_BYTES):
            last.append(entry)
        else:
            runs.append([entry])
    return runs


def decode_item(data: memoryview, source: str, fqn: str) -> torch.Tensor:
    """One DCP tensor item as a tensor, never running code from it.

    Raises:
        CorruptShardError: the item is not a plain tensor.
    """
    tensor = decode_in_place(data)
    return tensor if tensor is not None else _load_weights_only(data, source, fqn)


def _load_weights_only(data: memoryview, source: str, fqn: str) -> torch.Tensor:
    """The slow, general path: ``torch.load`` with torch's own restricted unpickler."""
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refused it, or it is not a tensor file
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]  # torch's run long
        raise CorruptShardError(f"{source} has an item for {fqn!r} that is not a plain "
                                f"tensor and was refused: {reason}") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CorruptShardError(f"{source} has a {type(tensor).__name__} for {fqn!r}, "
                                "not a tensor")
    return tensor
