"""Check DCP's ``.metadata`` against the manifest before any tensor is read.

The allow-list unpickler (:mod:`.safe_pickle`) guarantees that ``.metadata`` runs no
code, not that it makes sense: its objects may hold any allowed value in any field.
DCP trusts them -- a ``relative_path`` of ``../other/__0_0.distcp`` is read from
outside the checkpoint folder, a missing index entry is a ``KeyError`` deep in a
load. So every entry is checked here: each tensor's chunks are well-formed and each
has a storage entry; each storage entry names a file the manifest lists (manifest
names are plain, so the read stays in the folder), lies inside that file and overlaps
no other; and no entry is a pickled object (we never write one). Anything else is
corruption.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from elastic_rt.checkpoint.manifest import Manifest
from elastic_rt.errors import CorruptShardError


def check_metadata(metadata: Metadata, manifest: Manifest, source: str) -> None:
    """Raise CorruptShardError (naming ``source``) unless ``metadata`` is consistent."""
    try:
        problem = _problem(metadata, {f.path: f.size for f in manifest.files})
    except (TypeError, AttributeError, ValueError) as exc:  # a field of the wrong type
        problem = f"a malformed entry ({type(exc).__name__}: {exc})"
    if problem is not None:
        raise CorruptShardError(f"{source} does not match the manifest: {problem}")


def _problem(metadata: Metadata, sizes: dict[str, int]) -> str | None:
    tensors, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(tensors, dict) or not isinstance(storage, dict):
        return "its index is not a mapping"
    for fqn, entry in tensors.items():
        problem = _tensor_problem(fqn, entry, storage)
        if problem is not None:
            return problem
    for index, info in storage.items():
        problem = _storage_problem(index, info, sizes, tensors)
        if problem is not None:
            return problem
    return _overlap_problem(storage.values())


def _overlap_problem(infos: Any) -> str | None:
    """Items of one file never share bytes in what DCP writes (a read would hash them twice)."""
    ranges = sorted((i.relative_path, i.offset, i.offset + i.length) for i in infos)
    for (path, _, end), (other, start, _) in zip(ranges, ranges[1:]):
        if path == other and start < end:
            return f"two items overlap in {path!r} at byte {start}"
    return None


def _tensor_problem(fqn: Any, entry: Any, storage: dict[Any, Any]) -> str | None:
    if not isinstance(fqn, str):
        return f"a key of type {type(fqn).__name__}"
    if not isinstance(entry, TensorStorageMetadata):
        return f"{fqn!r} is a {type(entry).__name__}, not a tensor (a pickled object?)"
    if not (isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)):
        return f"{fqn!r} has no valid dtype"
    if not _is_shape(entry.size) or not isinstance(entry.chunks, list):
        return f"{fqn!r} has a malformed size or chunk list"
    for chunk in entry.chunks:
        if not (isinstance(chunk, ChunkStorageMetadata) and _is_shape(chunk.offsets)
                and _is_shape(chunk.sizes) and len(chunk.offsets) == len(entry.size)
                == len(chunk.sizes)
                and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))):
            return f"{fqn!r} has a chunk outside its size {tuple(entry.size)}"
        if MetadataIndex(fqn, chunk.offsets) not in storage:
            return f"{fqn!r} has a chunk at {tuple(chunk.offsets)} stored nowhere"
    return None


def _storage_problem(index: Any, info: Any, sizes: dict[str, int],
                     tensors: dict[str, Any]) -> str | None:
    if not isinstance(index, MetadataIndex) or index.fqn not in tensors:
        return f"a storage entry for {getattr(index, 'fqn', index)!r}, which is no tensor"
    if not isinstance(info, _StorageInfo) or info.transform_descriptors:
        return f"the storage entry of {index.fqn!r} is not a plain byte range"
    path, offset, length = info.relative_path, info.offset, info.length
    if not isinstance(path, str) or path not in sizes:
        return f"{index.fqn!r} is stored in {path!r}, which the manifest does not list"
    if path == ".metadata":
        return f"{index.fqn!r} is stored in the index itself"
    if not (type(offset) is int and type(length) is int and 0 <= offset
            and 0 <= length and offset + length <= sizes[path]):
        return f"{index.fqn!r} lies outside {path!r} ({offset!r}+{length!r})"
    return None


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)
