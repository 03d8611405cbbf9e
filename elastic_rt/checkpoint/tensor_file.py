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
from typing import Any

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
    try:
        members = _members(view)
        order = members.get("byteorder")
        if order is not None and bytes(view[order[0]:order[0] + order[1]]).decode() != (
                sys.byteorder):
            return None
        start, size = members["data.pkl"]
        plan = _RecordingUnpickler(io.BytesIO(view[start:start + size])).load()
        if not isinstance(plan, _Rebuild) or not isinstance(plan.storage, _Storage):
            return None
        start, size = members[f"data/{plan.storage.key}"]
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, ValueError, TypeError,
            AttributeError, EOFError, UnicodeDecodeError, struct.error, IndexError):
        return None
    return _view_record(view[start:start + size], plan)


_END = struct.Struct("<4s6xHIIH")  # signature, entries, directory size and offset, comment
_CENTRAL = struct.Struct("<4s6xH8xI4xHHH8xI")  # sig, method, size, 3 lengths, local offset


def _members(view: memoryview) -> dict[str, tuple[int, int]]:
    """Member name (without the archive folder) -> (data offset, size), read from the
    zip's central directory. Stored members only; anything else raises BadZipFile.
    """
    signature, count, _, directory, comment = _END.unpack_from(view, len(view) - _END.size)
    if signature != b"PK\x05\x06" or directory == 0xFFFFFFFF or comment:
        raise zipfile.BadZipFile("no plain end-of-directory record (zip64 or a comment)")
    members: dict[str, tuple[int, int]] = {}
    pos = directory
    for _ in range(count):
        sig, method, size, name_len, extra_len, comment_len, local = _CENTRAL.unpack_from(
            view, pos)
        if sig != b"PK\x01\x02" or method != zipfile.ZIP_STORED or 0xFFFFFFFF in (size, local):
            raise zipfile.BadZipFile("not a plain stored member")
        name = bytes(view[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]).decode()
        members[name.split("/", 1)[-1]] = (_data_start(view, local), size)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return members


def _data_start(view: memoryview, local: int) -> int:
    signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, local)
    if signature != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local header")
    return local + _LOCAL_HEADER.size + name_len + extra_len


def _view_record(record: memoryview, plan: _Rebuild) -> torch.Tensor | None:
    nbytes = plan.storage.numel * plan.storage.dtype.itemsize
    if len(record) < nbytes:
        return None
    if nbytes == 0:
        flat = torch.empty(0, dtype=plan.storage.dtype)
    else:
        flat = torch.frombuffer(record[:nbytes], dtype=plan.storage.dtype)
    try:
        return flat.as_strided(plan.size, plan.stride, plan.offset)
    except RuntimeError:
        return None
