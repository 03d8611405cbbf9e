"""Sharded checkpoints on an fsspec URL (local disk, S3, memory).

``Checkpointer`` saves through torch.distributed.checkpoint into a fresh folder per
step, commits with a JSON manifest written last (plus the run's fenced pointer),
writes in the background, checks every file on load, and never unpickles from
storage. ``inspect.ls`` / ``inspect.verify`` back ``elastic-rt checkpoint``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic_rt.lazy_names import resolve

if TYPE_CHECKING:  # the names' types, for mypy and readers
    from elastic_rt.checkpoint.checkpointer import Checkpointer, CheckpointInfo  # noqa: F401
    from elastic_rt.checkpoint.manifest import FileEntry  # noqa: F401
    from elastic_rt.checkpoint.pointer import PointerStore  # noqa: F401

_EXPORTS = {
    "Checkpointer": "elastic_rt.checkpoint.checkpointer",
    "CheckpointInfo": "elastic_rt.checkpoint.checkpointer",
    "FileEntry": "elastic_rt.checkpoint.manifest",
    "PointerStore": "elastic_rt.checkpoint.pointer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Names on first use: a worker that reads only the run's fence (``pointer``) must not
    load torch.distributed.checkpoint and DTensor (0.6 s of its start) for a job that
    writes no checkpoint."""
    return resolve(__name__, _EXPORTS, name)
