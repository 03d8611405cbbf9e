"""Read DCP's ``.metadata`` without running code from storage.

torch.distributed.checkpoint (2.13) writes its metadata with plain ``pickle``, and
``pickle.load`` calls whatever a file names. We unpickle with an allow-list instead:
only DCP's metadata dataclasses and the torch values they hold (``torch.Size``,
dtypes, the layout and memory-format decoders) can be named. Anything else, say a
``__reduce__`` that calls ``os.system``, is refused before it is looked up, so it
never runs. The result must be a ``Metadata``.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from elastic_rt.errors import CorruptShardError

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = (
    dcp_filesystem._StorageInfo
)
_ALLOWED[("torch", "Size")] = torch.Size
# Turns a layout's name ("torch.strided") back into the layout; a dict lookup.
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
# A local checkpoint id may be a path object; constructing one runs no user code.
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PosixPath
_ALLOWED[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id")


def load_metadata(data: bytes, source: str) -> dcp_metadata.Metadata:
    """Unpickle DCP metadata through the allow-list.

    Raises:
        CorruptShardError: the bytes name anything outside the allow-list, are not a
            pickle, or do not hold a ``Metadata``.
    """
    try:
        result = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling failure means the file is not what DCP wrote
        raise CorruptShardError(
            f"{source} is not plain checkpoint metadata and was not loaded: {exc}"
        ) from exc
    if not isinstance(result, dcp_metadata.Metadata):
        raise CorruptShardError(
            f"{source} holds a {type(result).__name__}, not checkpoint metadata"
        )
    return result
