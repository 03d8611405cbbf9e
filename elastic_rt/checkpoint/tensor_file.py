"""Decode one DCP tensor item (a ``torch.save`` zip) in place, without pickle or copies.

DCP stores each tensor item as a small ``torch.save`` archive: ``data.pkl`` (a pickle
naming ``torch._utils._rebuild_tensor_v2``, a typed storage class and the size and
stride) plus the raw bytes in ``data/<key>``, stored uncompressed. ``torch.load``
would copy those bytes into a fresh storage before DCP copies them again into the
target. We read ``data.pkl`` with an allow-list unpickler that only records the
arguments (it runs nothing), find the raw record through the zip directory, and
return a tensor *viewing* the caller's buffer: the only copy left is into the target.

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


class BufferFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview; reads copy only what they return."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view = view
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        chunk = self.view[self.pos:self.pos + len(buffer)]
        memoryview(buffer).cast("B")[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def decode_in_place(view: memoryview) -> torch.Tensor | None:
    """A tensor viewing ``view`` (which must stay unchanged while it is used), or None."""
    try:
        archive = zipfile.ZipFile(BufferFile(view))
        members = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        order = members.get("byteorder")
        if order is not None and archive.read(order).decode() != sys.byteorder:
            return None
        plan = _RecordingUnpickler(io.BytesIO(archive.read(members["data.pkl"]))).load()
        if not isinstance(plan, _Rebuild) or not isinstance(plan.storage, _Storage):
            return None
        record = members[f"data/{plan.storage.key}"]
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, ValueError, TypeError,
            AttributeError, EOFError, UnicodeDecodeError, struct.error):
        return None
    return _view_record(view, record, plan)


def _view_record(view: memoryview, record: zipfile.ZipInfo, plan: _Rebuild) -> torch.Tensor | None:
    signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, record.header_offset)
    start = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    nbytes = plan.storage.numel * plan.storage.dtype.itemsize
    if (signature != b"PK\x03\x04" or record.compress_type != zipfile.ZIP_STORED
            or record.file_size < nbytes or start + nbytes > len(view)):
        return None
    if nbytes == 0:
        flat = torch.empty(0, dtype=plan.storage.dtype)
    else:
        flat = torch.frombuffer(view[start:start + nbytes], dtype=plan.storage.dtype)
    try:
        return flat.as_strided(plan.size, plan.stride, plan.offset)
    except RuntimeError:
        return None
