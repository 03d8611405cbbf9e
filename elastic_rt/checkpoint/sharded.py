"""DCP save and load through fsspec, with checksums and without pickle.

Saving uses ``torch.distributed.checkpoint`` with an :class:`FsspecWriter` whose
streams compute each file's size and checksum as the bytes go by, so integrity costs
no second pass. Each rank writes only its own shards, and DCP's planner writes a
data-parallel replica once.

Loading reads DCP's ``.metadata`` with the restricted unpickler and the data through
our :class:`~.verified_read.VerifyingReader` (every byte checked, no pickle). DCP's
planner does the resharding: any saved layout loads into any sharding of ``state``
(plain tensors, DTensors, per-rank differing keys).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint._fsspec_filesystem import (
    FileSystem,
    FsspecWriter,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from elastic_rt.checkpoint.checksum import checksum_of, new_hasher
from elastic_rt.checkpoint.manifest import FileEntry, Manifest, read_manifest
from elastic_rt.checkpoint.metadata_check import check_metadata
from elastic_rt.checkpoint.safe_pickle import load_metadata
from elastic_rt.checkpoint.storage import NOT_A_FILE, FsspecStorage, translate_error
from elastic_rt.checkpoint.verified_read import VerifyingReader
from elastic_rt.errors import CheckpointMismatchError, CorruptShardError, ElasticError

logger = logging.getLogger(__name__)

METADATA_FILE = ".metadata"

# DCP warns on every single-process save/load; a single process is a supported use.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")


class _ChecksumStream(io.RawIOBase):
    """Write-through stream that keeps the size and checksum of what was written."""

    def __init__(self, inner: Any, on_write: Callable[[int], None]) -> None:
        super().__init__()
        self.inner = inner
        self.on_write = on_write
        self.size = 0
        self.hasher = new_hasher()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
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
    """DCP's fsspec file system for one fresh checkpoint folder.

    It records the size and checksum of every file written. It also drops two
    safeguards of DCP's that protect nothing here: the check that ``.metadata`` does
    not exist yet, and writing it as ``.metadata.tmp`` then renaming it. Our folder
    has a fresh random name and is invisible until the manifest lands, so nothing
    else is in it; and on an object store the check costs a HEAD and a LIST, and the
    rename a copy and a delete (6 of the 16 requests a small save made on S3).
    A local file system keeps the rename (it is atomic and costs nothing).
    """

    def __init__(self, fs: Any, *, is_local: bool) -> None:
        super().__init__()
        self.fs = fs
        self.is_local = is_local
        self.records: dict[str, FileEntry] = {}
        self.failures: list[BaseException] = []
        """Errors of file writes, swallowed here and raised by :func:`write_shards` once
        DCP returns: DCP loses an error raised in one of its extra writer threads (the
        thread dies with a traceback on stderr and its files are silently left out of
        the checkpoint), so a failed file must not depend on DCP to fail the save."""
        self.written = 0
        """Bytes written so far, for progress reports."""
        self._lock = threading.Lock()

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.written += nbytes

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return path

    def mkdir(self, path: str | os.PathLike) -> None:
        if self.is_local:  # an object store has no folders to make
            super().mkdir(path)

    def exists(self, path: str | os.PathLike) -> bool:
        return False  # a fresh folder (see the class docstring)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = os.fspath(path)
        if not self.is_local and target.endswith(".tmp"):
            target = target[: -len(".tmp")]  # written under its final name; see rename
        try:
            with super().create_stream(target, mode) as raw:
                stream = _ChecksumStream(raw, self._count)
                yield stream
        except Exception as exc:  # kept for write_shards; see ``failures``
            with self._lock:
                self.failures.append(exc)
            return
        entry = FileEntry(os.path.basename(path), stream.size, stream.hasher.value())
        with self._lock:
            self.records[entry.path] = entry

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        if self.is_local:
            super().rename(path, new_path)
        with self._lock:
            old = self.records.pop(os.path.basename(path), None)
            if old is not None:
                name = os.path.basename(new_path)
                self.records[name] = FileEntry(name, old.size, old.checksum)


OBJECT_STORE_FILES_PER_RANK = 4
"""Most files each rank writes (and later reads) at once on an object store: one S3
stream is slow, several in parallel are how S3 reaches its throughput. Local disks
get one sequential file per rank."""

PARALLEL_FILE_BYTES = 16 << 20
"""Smallest share of a rank's bytes worth a file (and a request) of its own: at
S3's ~80 MB/s per stream it takes ~0.2 s, well above a request's latency. Below it,
the extra requests cost more than the parallelism gains (measured on moto, 34 MB
saved by 2 ranks: 8 files load in 1.41x a raw download's time, 2 files in 1.11x)."""


def files_per_rank(storage: FsspecStorage, nbytes: int) -> int:
    """How many files one rank writes ``nbytes`` into (see the constants above)."""
    if storage.is_local:
        return 1
    return max(1, min(OBJECT_STORE_FILES_PER_RANK, nbytes // PARALLEL_FILE_BYTES))


class ChecksummingWriter(FsspecWriter):
    """An :class:`FsspecWriter` on our storage whose files carry checksums."""

    def __init__(self, storage: FsspecStorage, name: str, files: int) -> None:
        super().__init__(storage.url_of(name), sync_files=storage.is_local, thread_count=files,
                         overwrite=False, **storage.storage_options)
        self.checksums = _ChecksumFileSystem(storage.fs, is_local=storage.is_local)
        self.fs = self.checksums  # type: ignore[assignment]  # DCP's own FileSystem type
        self.path = storage.path(name)

    @property
    def records(self) -> dict[str, FileEntry]:
        return dict(self.checksums.records)


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
    total = sum(_local_bytes(t) for t in tensors.values())
    writer = ChecksummingWriter(storage, name, files_per_rank(storage, total))
    with _unwrapped(storage.url_of(name)), _progress(writer.checksums, storage.url_of(name), total):
        dcp.save(tensors, storage_writer=writer, process_group=group,
                 planner=DefaultSavePlanner(flatten_state_dict=False),
                 no_dist=group is None and not _dist_ready())
    if writer.checksums.failures:  # DCP finished without the files its extra threads failed
        raise translate_error(writer.checksums.failures[0], storage.url_of(name))
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


def read_shards(tensors: dict[str, torch.Tensor], storage: FsspecStorage, header: Header,
                group: dist.ProcessGroup | None) -> None:
    """Load the checkpoint into ``tensors`` in place, resharding as needed; collective.

    ``header`` comes from :func:`read_header`, checked with :func:`check_fits`.

    Raises:
        CorruptShardError: a file is missing, fails its check, or holds a pickle.
    """
    reader = VerifyingReader(storage, header.manifest, header.metadata, header.sizes)
    with _unwrapped(storage.url_of(header.manifest.name)):
        dcp.load(tensors, storage_reader=reader, process_group=group,
                 planner=_SafeLoadPlanner(flatten_state_dict=False),
                 no_dist=group is None and not _dist_ready())


@dataclass(frozen=True)
class Header:
    """What a load reads before any tensor: the manifest, DCP's ``.metadata`` (both
    checked) and, on an object store, the folder's object sizes (one listing), so a
    longer or shorter object is caught before its bytes are read, as ``verify`` does."""

    manifest: Manifest
    metadata: Metadata
    sizes: dict[str, int] | None


def read_header(storage: FsspecStorage, name: str) -> Header | None:
    """The checked :class:`Header` of ``name``; None when it has no manifest (a save
    that never committed).

    The reads are requested at once: on an object store they cost one round trip.

    Raises:
        CorruptShardError: the manifest is invalid, or ``.metadata`` is missing, fails
            its check, or does not match the manifest (:mod:`.metadata_check`).
    """
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-header") as pool:
        pending = pool.submit(_read_or_none, storage, f"{name}/{METADATA_FILE}")
        listing = None if storage.is_local else pool.submit(storage.list_files, name)
        manifest = read_manifest(storage, name, missing_ok=True)
        data = pending.result()
        sizes = None if listing is None else listing.result()
    if manifest is None:
        return None
    source = storage.url_of(f"{name}/{METADATA_FILE}")
    expected = {f.path: f for f in manifest.files}.get(METADATA_FILE)
    if data is None:
        raise CorruptShardError(f"{source} is missing or not a file")
    if expected is None or (len(data), checksum_of(data, expected.checksum)) != (
            expected.size, expected.checksum):
        raise CorruptShardError(f"{source} fails its check against the manifest")
    metadata = load_metadata(data, source)
    check_metadata(metadata, manifest, source)
    return Header(manifest, metadata, sizes)


def _read_or_none(storage: FsspecStorage, rel: str) -> bytes | None:
    try:
        return storage.read_bytes(rel, nonempty=True)  # DCP never writes it empty
    except NOT_A_FILE:
        return None


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


def _local_bytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor`` this rank holds (a DTensor's local shard)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


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
