"""A save becomes a checkpoint: one manifest from every rank's parts, written last.

The rule: a checkpoint is committed once its manifest is in storage and, with a run's
pointer, the pointer names it; rank 0 does both, in that order, only after checking
that every rank's files are still where they were written (another process may have
removed the folder, and a manifest alone is no checkpoint). The pointer's commit is
fenced by the token of the round the state was saved in (:class:`~.pointer.Fence`).
Retention runs after a commit, on rank 0: it keeps the newest ``keep`` loadable
checkpoints and removes the rest, including a partial folder once nothing in it has
changed for :data:`PARTIAL_GRACE_S` (until then a live writer may still be filling it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

from elastic_rt.checkpoint.manifest import (
    MANIFEST_FILE,
    FileEntry,
    Manifest,
    names_to_remove,
    read_manifest,
    write_manifest,
)
from elastic_rt.checkpoint.pointer import Fence, PointerStore
from elastic_rt.checkpoint.storage import FsspecStorage
from elastic_rt.errors import CheckpointError, CorruptShardError

logger = logging.getLogger(__name__)

PARTIAL_GRACE_S = 600.0
"""Retention deletes a folder without a manifest only when nothing in it changed for
this long: before that, a live writer may still be filling it (a save's files appear
one by one, each within well under this time)."""


def merge_files(parts: list[tuple[dict[str, FileEntry], dict]]) -> tuple[FileEntry, ...]:
    """Every rank's file records, once each, sorted by path."""
    files: dict[str, FileEntry] = {}
    for records, _ in parts:
        files.update(records)
    return tuple(sorted(files.values(), key=lambda f: f.path))


def merge_objects(parts: list[tuple[dict, dict[str, Any]]]) -> dict[str, Any]:
    """Union of every rank's plain values; where ranks differ, the lowest rank wins."""
    merged: dict[str, Any] = {}
    for rank, (_, objects) in enumerate(parts):
        for key, value in objects.items():
            if key in merged and merged[key] != value:
                logger.warning("state value %r differs on rank %d; keeping the lowest rank's",
                               key, rank)
                continue
            merged.setdefault(key, value)
    return merged


def commit(storage: FsspecStorage, manifest: Manifest, pointer: PointerStore | None,
           fence: Fence | None) -> None:
    """Rank 0: check the files, write the manifest, then move the pointer (fenced).

    Raises:
        CheckpointError: a file of the save is gone or has another size.
        FencedOutError: ``fence``'s round is no longer current (the pointer stays).
    """
    check_still_there(storage, manifest)
    write_manifest(storage, manifest)
    if pointer is not None:
        pointer.commit(manifest.name, step=manifest.step,
                       token=fence.token if fence is not None else None)


def check_still_there(storage: FsspecStorage, manifest: Manifest) -> None:
    """Every rank's files are where they were written, or the save fails.

    Raises:
        CheckpointError: naming how many files are lost and the first of them.
    """
    found = storage.list_files(manifest.name)
    lost = [f.path for f in manifest.files if found.get(f.path) != f.size]
    if lost:
        raise CheckpointError(
            f"{storage.url_of(manifest.name)} lost {len(lost)} of its "
            f"{len(manifest.files)} files while it was being saved (first: {lost[0]}); "
            "another process removed them, so it was not committed")


def retain(storage: FsspecStorage, *, committed: str, pointer_name: str | None, keep: int,
           known_bad: Collection[str]) -> None:
    """Rank 0, after committing ``committed``: remove what retention does not keep.

    Housekeeping: a failure is logged, never raised (the commit already happened).
    """
    def loadable(name: str) -> bool:
        if name == committed:
            return True
        try:
            return (name not in known_bad
                    and read_manifest(storage, name, missing_ok=True) is not None)
        except CorruptShardError:
            return False

    def settled(name: str) -> bool:
        if storage.exists(f"{name}/{MANIFEST_FILE}"):
            return True  # a manifest is the last thing a writer writes
        changed = storage.last_change(name)
        return changed is None or time.time() - changed > PARTIAL_GRACE_S

    try:
        doomed = names_to_remove(storage.list_dirs(), pointer_name, keep, {committed},
                                 loadable, settled)
        for name in doomed:
            logger.info("retention removes %s", storage.url_of(name))
            storage.remove_tree(name)
    except Exception as exc:  # retention is housekeeping: the commit already happened
        logger.warning("retention under %s failed: %s", storage.url, exc)
