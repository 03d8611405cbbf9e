"""Sharded checkpoints on an fsspec URL (local disk, S3, memory).

``Checkpointer`` saves through torch.distributed.checkpoint into a fresh folder per
step, commits with a JSON manifest written last (plus the run's fenced pointer),
writes in the background, checks every file on load, and never unpickles from
storage. ``inspect.ls`` / ``inspect.verify`` back ``elastic-rt checkpoint``.
"""

from elastic_rt.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from elastic_rt.checkpoint.manifest import FileEntry
from elastic_rt.checkpoint.pointer import PointerStore

__all__ = ["Checkpointer", "CheckpointInfo", "FileEntry", "PointerStore"]
