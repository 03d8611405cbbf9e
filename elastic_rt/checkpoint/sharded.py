"""DCP save and load through fsspec, with checksums and without pickle.

Saving uses ``torch.distributed.checkpoint`` with an :class:`FsspecWriter` whose
streams compute each file's size and CRC-32 as the bytes go by, so integrity costs
no second pass. Each rank writes only its own shards, and DCP's planner writes a
data-parallel replica once.

Loading uses our own reader. It reads DCP's ``.metadata`` with the restricted
unpickler, refuses pickled (``BYTE_IO``) items, decodes tensors in place
(:mod:`.tensor_file`; ``torch.load(weights_only=True)`` for anything unusual), and
reads every file it touches from start to end in one sequential pass into one
reused buffer, checking size and CRC-32 against the manifest at the end. DCP's planner does the resharding: any saved layout loads into any
sharding of ``state`` (plain tensors, DTensors, per-rank differing keys).

Note:
    A corrupt file is detected after the items before the damage were copied in, so
    a failed load leaves ``state`` partly overwritten; the caller's fallback load
    overwrites it again.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import (
    FileSystem,
    FsspecReader,
    FsspecWriter,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from elastic_rt.checkpoint.manifest import FileEntry, Manifest
from elastic_rt.checkpoint.safe_pickle import load_metadata
from elastic_rt.checkpoint.storage import FsspecStorage, translate_error
from elastic_rt.checkpoint.tensor_file import decode_in_place
from elastic_rt.errors import CheckpointMismatchError, CorruptShardError, ElasticError

logger = logging.getLogger(__name__)

METADATA_FILE = ".metadata"

# DCP warns on every single-process save/load; a single process is a supported use.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
_CHUNK = 8 << 20


class _ChecksumStream(io.RawIOBase):
    """Write-through stream that keeps the size and CRC-32 of what was written."""

    def __init__(self, inner: Any, on_write: Callable[[int], None]) -> None:
        super().__init__()
        self.inner = inner
        self.on_write = on_write
        self.size = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        self.inner.write(view)
        self.on_write(len(view))
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()


class _ChecksumFileSystem(FileSystem):
    """DCP's fsspec file system, recording size and CRC-32 of every file written."""

    def __init__(self, fs: Any) -> None:
        super().__init__()
        self.fs = fs
        self.records: dict[str, FileEntry] = {}
        self.written = 0
        """Bytes written so far, for progress reports."""
        self._lock = threading.Lock()

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.written += nbytes

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return path

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksumStream(raw, self._count)
            yield stream
        entry = FileEntry(os.path.basename(path), stream.size, f"{stream.crc:08x}")
        with self._lock:
            self.records[entry.path] = entry

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            old = self.records.pop(os.path.basename(path), None)
            if old is not None:
                name = os.path.basename(new_path)
                self.records[name] = FileEntry(name, old.size, old.crc32)


class ChecksummingWriter(FsspecWriter):
    """An :class:`FsspecWriter` on our storage whose files carry checksums."""

    def __init__(self, storage: FsspecStorage, name: str) -> None:
        super().__init__(storage.url_of(name), sync_files=storage.is_local,
                         overwrite=False, **storage.storage_options)
        self.fs = _ChecksumFileSystem(storage.fs)
        self.path = storage.path(name)

    @property
    def records(self) -> dict[str, FileEntry]:
        return dict(self.fs.records)


class VerifyingReader(FsspecReader):
    """Reads one checkpoint: verified, sequential, no pickle (see module docstring)."""

    def __init__(self, storage: FsspecStorage, manifest: Manifest, metadata: Metadata) -> None:
        super().__init__(storage.url_of(manifest.name), **storage.storage_options)
        self.fs = FileSystem()
        self.fs.fs = storage.fs
        self.path = storage.path(manifest.name)
        self._url = storage.url_of(manifest.name)
        self._metadata = metadata
        self._expected = {f.path: f for f in manifest.files}

    def read_metadata(self) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item)
        for rel, items in per_file.items():
            self._read_file(rel, items, planner)
        future: TorchFuture[None] = TorchFuture()
        future.set_result(None)
        return future

    def _read_file(self, rel: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        source = f"{self._url}/{rel}"
        expected = self._expected.get(rel)
        if expected is None:
            raise CorruptShardError(f"{source} is not listed in the manifest")
        items = sorted(items, key=lambda i: self.storage_data[i.storage_index].offset)
        refused: CorruptShardError | None = None
        try:
            with self.fs.create_stream(os.path.join(self.path, rel), "rb") as raw:
                largest = max(self.storage_data[i.storage_index].length for i in items)
                reader = _VerifyingStream(raw, largest)
                try:
                    for item in items:
                        info = self.storage_data[item.storage_index]
                        reader.skip_to(info.offset)
                        try:
                            self._load_item(item, reader.read(info.length), planner, source)
                        except CorruptShardError as exc:
                            refused = exc  # a damaged file explains it better: check first
                            break
                    reader.skip_to(None)
                finally:
                    crc = reader.finish()
        except FileNotFoundError as exc:
            raise CorruptShardError(f"{source} is missing") from exc
        if (reader.size, f"{crc:08x}") != (expected.size, expected.crc32):
            raise CorruptShardError(
                f"{source} fails its check: {reader.size} bytes with CRC-32 "
                f"{crc:08x}, the manifest says {expected.size} bytes with "
                f"{expected.crc32}"
            )
        if refused is not None:
            raise refused

    def _load_item(self, item: ReadItem, data: memoryview, planner: LoadPlanner,
                   source: str) -> None:
        if item.type == LoadItemType.BYTE_IO:
            raise CorruptShardError(f"{source} holds a pickled object for {item.dest_index.fqn!r};"
                                    " it was refused")
        tensor = decode_in_place(data)
        if tensor is None:
            tensor = _load_weights_only(data, source, item.dest_index.fqn)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptShardError(f"{source} has shape {tuple(tensor.size())} for "
                                    f"{item.dest_index.fqn!r}, expected {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _load_weights_only(data: memoryview, source: str, fqn: str) -> torch.Tensor:
    """The slow, general path: ``torch.load`` with torch's own restricted unpickler."""
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refused it, or it is not a tensor file
        raise CorruptShardError(f"{source} has an item for {fqn!r} that is not a plain "
                                f"tensor and was refused: {exc}") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CorruptShardError(f"{source} has a {type(tensor).__name__} for {fqn!r}, "
                                "not a tensor")
    return tensor


class _VerifyingStream:
    """Reads a file front to back into one reused buffer, hashing every byte.

    The CRC of an item runs in a helper thread (zlib releases the GIL) while the
    caller decodes and copies the item; it is waited for before the buffer is reused.
    """

    def __init__(self, raw: Any, capacity: int) -> None:
        self.raw = raw
        self.size = 0
        self._crc = 0
        self._buffer = bytearray(max(capacity, 1))
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc")
        self._pending: Future | None = None

    def read(self, length: int) -> memoryview:
        """The next ``length`` bytes (fewer at the end), valid until the next read."""
        self._settle()
        if length > len(self._buffer):
            self._buffer = bytearray(length)
        view = memoryview(self._buffer)[:length]
        filled = 0
        while filled < length:
            got = self.raw.readinto(view[filled:])
            if not got:
                break
            filled += got
        self.size += filled
        self._pending = self._hasher.submit(self._update, view[:filled])
        return view[:filled]

    def _update(self, data: memoryview) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def _settle(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def skip_to(self, offset: int | None) -> None:
        """Hash up to ``offset`` (None: to the end)."""
        while offset is None or self.size < offset:
            want = _CHUNK if offset is None else min(_CHUNK, offset - self.size)
            if not len(self.read(want)):
                return

    def finish(self) -> int:
        """The CRC-32 of everything read; waits for and stops the helper thread."""
        self._settle()
        self._hasher.shutdown(wait=True)
        return self._crc


class _SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CorruptShardError(f"refused a pickled object for {read_item.dest_index.fqn!r}")


def write_shards(tensors: dict[str, torch.Tensor], storage: FsspecStorage, name: str,
                 group: dist.ProcessGroup | None) -> dict[str, FileEntry]:
    """DCP-save ``tensors`` into ``name``; collective over ``group``.

    Returns:
        This rank's files (including ``.metadata`` on the coordinator) with checksums.

    Raises:
        ElasticError: on every rank if any rank failed (DCP gathers failures).
    """
    writer = ChecksummingWriter(storage, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with _unwrapped(storage.url_of(name)), _progress(writer.fs, storage.url_of(name), total):
        dcp.save(tensors, storage_writer=writer, process_group=group,
                 planner=DefaultSavePlanner(flatten_state_dict=False),
                 no_dist=group is None and not _dist_ready())
    return writer.records


@contextlib.contextmanager
def _progress(fs: _ChecksumFileSystem, url: str, total: int,
              every: float = 5.0) -> Iterator[None]:
    """Log how far a long write has got, every ``every`` seconds (an upload can take minutes)."""
    done = threading.Event()
    began = time.monotonic()

    def report() -> None:
        while not done.wait(every):
            logger.info("writing checkpoint %s: %.1f of %.1f MB after %.0f s", url,
                        fs.written / 1e6, total / 1e6, time.monotonic() - began)

    thread = threading.Thread(target=report, name="ckpt-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def read_shards(tensors: dict[str, torch.Tensor], storage: FsspecStorage, manifest: Manifest,
                metadata: Metadata, group: dist.ProcessGroup | None) -> None:
    """Load the checkpoint into ``tensors`` in place, resharding as needed; collective.

    ``metadata`` comes from :func:`read_metadata`, checked with :func:`check_fits`.

    Raises:
        CorruptShardError: a file is missing, fails its check, or holds a pickle.
    """
    reader = VerifyingReader(storage, manifest, metadata)
    with _unwrapped(storage.url_of(manifest.name)):
        dcp.load(tensors, storage_reader=reader, process_group=group,
                 planner=_SafeLoadPlanner(flatten_state_dict=False),
                 no_dist=group is None and not _dist_ready())


def read_metadata(storage: FsspecStorage, manifest: Manifest) -> Metadata:
    """Read ``.metadata`` (checked against the manifest) through the allow-list."""
    rel = f"{manifest.name}/{METADATA_FILE}"
    source = storage.url_of(rel)
    expected = {f.path: f for f in manifest.files}.get(METADATA_FILE)
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError as exc:
        raise CorruptShardError(f"{source} is missing") from exc
    if expected is None or (len(data), f"{zlib.crc32(data):08x}") != (expected.size,
                                                                       expected.crc32):
        raise CorruptShardError(f"{source} fails its check against the manifest")
    return load_metadata(data, source)


def check_fits(tensors: dict[str, torch.Tensor], metadata: Metadata, source: str) -> None:
    """Raise CheckpointMismatchError unless every tensor key exists with its global shape."""
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in tensors if k not in saved)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointMismatchError(
            f"checkpoint {source} has no tensor {', '.join(map(repr, missing[:3]))}{more}",
            "Load a checkpoint of this model, or build the model the checkpoint was saved from.",
        )
    for key, tensor in tensors.items():
        entry = saved[key]
        if not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != tuple(
                tensor.shape):
            shape = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "object"
            raise CheckpointMismatchError(
                f"checkpoint {source} has {key!r} with shape {shape}, the model has "
                f"{tuple(tensor.shape)}",
                "Load a checkpoint of this model, or build the model the checkpoint was "
                "saved from.",
            )


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _unwrapped(url: str) -> Iterator[None]:
    """Turn DCP's CheckpointException (a BaseException) into our error."""
    try:
        yield
    except CheckpointException as exc:
        raise first_failure(exc, url) from exc


def first_failure(exc: CheckpointException, url: str) -> BaseException:
    """The most telling failure in a CheckpointException, as one of our errors."""
    errors = [failure[0] if isinstance(failure, tuple) else failure
              for _, failure in sorted(exc.failures.items())]
    for wanted in (CorruptShardError, CheckpointMismatchError, ElasticError):
        for error in errors:
            if isinstance(error, wanted):
                return error
    return translate_error(errors[0], url) if errors else translate_error(exc, url)
