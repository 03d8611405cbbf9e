"""Decode one DCP tensor item (a ``torch.save`` zip) in place, without pickle or copies.

DCP stores each tensor item as a small ``torch.save`` archive: ``data.pkl`` (a pickle
naming ``torch._utils._rebuild_tensor_v2``, a typed storage class and the size and
stride) plus the raw bytes in ``data/<key>``, stored uncompressed. ``torch.load``
would copy those bytes into a fresh storage before DCP copies them again into the
target, and parses each archive in about a millisecond. We read the zip's central
directory with ``struct`` (tens of microseconds), read ``data.pkl`` with an
allow-list unpickler that only records the arguments (it runs nothing), and return
a tensor *viewing* the caller's buffer: the only copy left is into the target.

Anything outside that simple shape returns None, and the caller falls back to
``torch.load(weights_only=True)``, which is slower but equally safe.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Records may view immutable bytes fetched from an object store; the tensors built
# on them are only read (copied into the model), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, skipped fields, name and extra lengths


def _storage_dtypes() -> dict[str, torch.dtype]:
    """``FloatStorage`` -> float32 ... (reading ``.dtype`` warns that TypedStorage is old)."""
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in (n for n in dir(torch) if n.endswith("Storage")):
            dtype = getattr(getattr(torch, name), "dtype", None)
            if isinstance(dtype, torch.dtype):
                found[name] = dtype
    return found


_STORAGE_DTYPES = _storage_dtypes()


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _Rebuild:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any,
                       *_: Any) -> _Rebuild:
    return _Rebuild(storage, int(storage_offset), tuple(size), tuple(stride))


class _RecordingUnpickler(pickle.Unpickler):
    """Admits only what a plain tensor's ``data.pkl`` names; builds descriptions."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        kind, storage_type, key, _location, numel = pid
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError("not a plain tensor storage")
        return _Storage(storage_type.dtype, str(key), int(numel))


def decode_in_place(view: memoryview) -> torch.Tensor | None:
    """A tensor viewing ``view`` (which must stay unchanged while it is used), or None."""
    found = locate(lambda start, size: view[start:start + size], len(view))
    if found is None:
        return None
    return _view_record(view[found.start:found.start + found.nbytes], found)


@dataclass(frozen=True)
class TensorRecord:
    """Where a plain tensor's bytes lie in its record, and how to view them."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """The tensor's storage offset, in elements."""
    numel: int
    """Elements in its storage."""
    start: int
    """Where the storage's bytes start in the record."""

    @property
    def nbytes(self) -> int:
        """The storage's bytes (the record may hold more: then the rest is unused)."""
        return self.numel * self.dtype.itemsize


Read = Callable[[int, int], memoryview]
"""``read(start, size)``: those bytes of a record; IndexError when they are not at hand."""


def locate(read: Read, length: int) -> TensorRecord | None:
    """Where the tensor of the ``length``-byte record that ``read`` reads lies, or None
    (not a plain tensor). Only the record's small parts are read: its zip directory (at
    the end), the local headers and ``data.pkl`` (at the start, before the data)."""
    if length < _END.size:
        return None
    try:
        members = _members(read, length)
        order = members.get("byteorder")
        if order is not None and bytes(read(*order)).decode() != sys.byteorder:
            return None
        plan = _RecordingUnpickler(io.BytesIO(read(*members["data.pkl"]))).load()
        if not isinstance(plan, _Rebuild) or not isinstance(plan.storage, _Storage):
            return None
        start, size = members[f"data/{plan.storage.key}"]
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, ValueError, TypeError,
            AttributeError, EOFError, UnicodeDecodeError, struct.error, IndexError):
        return None
    found = TensorRecord(plan.storage.dtype, plan.size, plan.stride, plan.offset,
                         plan.storage.numel, start)
    return found if 0 <= start and found.nbytes <= size and start + size <= length else None


_END = struct.Struct("<4s6xHIIH")  # signature, entries, directory size and offset, comment
_CENTRAL = struct.Struct("<4s6xH8xI4xHHH8xI")  # sig, method, size, 3 lengths, local offset


def _members(read: Read, length: int) -> dict[str, tuple[int, int]]:
    """Member name (without the archive folder) -> (data offset, size), read from the
    zip's central directory. Stored members only; anything else raises BadZipFile.
    """
    signature, count, size, directory, comment = _END.unpack(read(length - _END.size, _END.size))
    if signature != b"PK\x05\x06" or directory == 0xFFFFFFFF or comment:
        raise zipfile.BadZipFile("no plain end-of-directory record (zip64 or a comment)")
    entries = read(directory, size)
    members: dict[str, tuple[int, int]] = {}
    pos = 0
    for _ in range(count):
        sig, method, size, name_len, extra_len, comment_len, local = _CENTRAL.unpack_from(
            entries, pos)
        if sig != b"PK\x01\x02" or method != zipfile.ZIP_STORED or 0xFFFFFFFF in (size, local):
            raise zipfile.BadZipFile("not a plain stored member")
        name = bytes(entries[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]).decode()
        members[name.split("/", 1)[-1]] = (_data_start(read, local), size)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return members


def _data_start(read: Read, local: int) -> int:
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(read(local, _LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local header")
    return local + _LOCAL_HEADER.size + name_len + extra_len


def _view_record(record: memoryview, found: TensorRecord) -> torch.Tensor | None:
    if found.nbytes == 0:
        flat = torch.empty(0, dtype=found.dtype)
    else:
        flat = torch.frombuffer(record, dtype=found.dtype)
    try:
        return flat.as_strided(found.size, found.stride, found.offset)
    except RuntimeError:
        return None
