"""The Checkpointer: sharded, atomic, asynchronous checkpoints on an fsspec URL.

Every save goes to a fresh folder ``<url>/step-<step>-g<generation>-<6 hex>/``, never
over an old one (an interrupted overwrite would mix two steps); its generation is past
every folder in storage and the checkpoint this process restored, so the newest
commit is the newest in :func:`~.manifest.order_key` order. Every rank writes its own
shards through DCP; rank 0 checks that they are all still there, then writes the JSON
manifest (the last file) and, when a pointer is given, commits the name in the run's
fenced pointer. Only then is the checkpoint committed and visible to
:meth:`Checkpointer.load`. Retention, on rank 0 after each commit, keeps the newest
``keep`` loadable checkpoints and removes the rest, including partial folders left by
crashed saves once nothing has changed in them for :data:`PARTIAL_GRACE_S` (until
then a live writer -- another process, a fenced-out round -- may be filling them).

Failure behaviour: a failure on any rank fails the save on every rank (nobody is
left in a collective), and is raised by the next :meth:`~Checkpointer.save` or
:meth:`~Checkpointer.wait`. A load first checks that the location exists (a
missing bucket or folder is an error, never a fresh start), then verifies the manifest,
DCP's metadata and every file it reads; when the newest checkpoint is corrupt,
``load(name=None)`` falls back to the one before it.

Background collectives run on a gloo group of their own, created next to the
training group, so a write in flight never interleaves with training collectives.
"""

from __future__ import annotations

import builtins
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_rt.checkpoint import coordination as coord
from elastic_rt.checkpoint.async_save import BackgroundWriter, Stager
from elastic_rt.checkpoint.manifest import (
    MANIFEST_FILE,
    DirState,
    FileEntry,
    Manifest,
    candidates,
    committed_names,
    names_to_remove,
    new_name,
    next_generation,
    parse_name,
    read_manifest,
    scan,
    write_manifest,
)
from elastic_rt.checkpoint.pointer import PointerStore
from elastic_rt.checkpoint.sharded import (
    Header,
    check_fits,
    read_header,
    read_shards,
    write_shards,
)
from elastic_rt.checkpoint.state_tree import FlatState, encode_objects, flatten
from elastic_rt.checkpoint.storage import FsspecStorage
from elastic_rt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptShardError,
)
from elastic_rt.events import EventSink
from elastic_rt.process_groups import destroy_side_group, side_group

logger = logging.getLogger(__name__)

PARTIAL_GRACE_S = 600.0
"""Retention deletes a folder without a manifest only when nothing in it changed for
this long: before that, a live writer may still be filling it (a save's files appear
one by one, each within well under this time)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as seen in storage."""

    name: str
    step: int
    url: str
    layout: dict[str, Any] | None
    extra: dict[str, Any]
    committed: bool
    nbytes: int
    files: tuple[FileEntry, ...] = field(default=())
    generation: int = 0
    problem: str | None = None
    """Why its manifest cannot be read (then it is not committed), else None."""

    @classmethod
    def of(cls, manifest: Manifest, url: str, committed: bool = True) -> "CheckpointInfo":
        return cls(manifest.name, manifest.step, url, manifest.layout, dict(manifest.extra),
                   committed, manifest.nbytes, manifest.files, manifest.generation)


class Checkpointer:
    """Saves and loads sharded checkpoints under one URL.

    Args:
        url: a local path, ``file://``, ``memory://`` or ``s3://bucket/prefix``.
        every_steps: :meth:`should_save` is true every this many steps (0: never).
        keep: committed checkpoints retention keeps (0 keeps all).
        async_save: stage and return, writing in the background (else write, then return).
        storage_options: fsspec options (S3: ``endpoint_url``...). Never logged.
        pointer: the run's fenced pointer; without one the manifest alone commits.
        events: where ``checkpoint.committed`` / ``checkpoint.restored`` go.
        collective_timeout: how long a background collective waits for a peer.

    Raises:
        UnknownURLSchemeError: the URL's scheme is not supported.
        ConfigError: ``every_steps`` or ``keep`` is negative.
    """

    def __init__(self, url: str, *, every_steps: int = 0, keep: int = 3, async_save: bool = True,
                 storage_options: dict | None = None, pointer: PointerStore | None = None,
                 events: EventSink | None = None,
                 collective_timeout: timedelta = timedelta(minutes=10)) -> None:
        for field_name, value in (("every_steps", every_steps), ("keep", keep)):
            if value < 0:
                raise ConfigError(f"Checkpointer {field_name}={value} is negative",
                                  f"Pass {field_name}=0 or more.")
        self.url = url.rstrip("/")
        self.every_steps = every_steps
        self.keep = keep
        self.async_save = async_save
        self._storage = FsspecStorage(url, storage_options)
        self._pointer = pointer
        self._events = events
        self._timeout = collective_timeout
        self._stager = Stager()
        self._writer = BackgroundWriter()
        self._side: tuple[Any, Any] | None = None
        self._round_of: Callable[[], int | None] = lambda: None
        self._unclaimed: CheckpointInfo | None = None
        self._generation = 0
        """The highest generation this process restored or saved; saves go past it."""
        self._known_bad: set[str] = set()
        """Checkpoints a load of ours found damaged: retention does not count them."""

    def __repr__(self) -> str:
        return f"Checkpointer({self.url!r}, every_steps={self.every_steps}, keep={self.keep})"

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step under ``every_steps``."""
        return self.every_steps > 0 and step > 0 and step % self.every_steps == 0

    def save(self, step: int, state: dict[str, Any], *, layout: dict | None = None,
             extra: dict | None = None, process_group: Any = None) -> None:
        """Checkpoint ``state`` at ``step``; collective over ``process_group``.

        Waits for the previous save first. With ``async_save`` it returns once the
        tensors are staged in CPU memory; :meth:`wait` gives the outcome.

        Raises:
            ConfigError: ``state`` or ``extra`` holds values we cannot store safely.
            CheckpointError: the previous save failed (its error, re-raised here).
        """
        self.wait()
        group = self._side_group(process_group)
        started = time.monotonic()
        try:
            flat = flatten(state)
            objects = encode_objects(flat.objects)
            extra = _checked_extra(extra)
            layout = _checked_layout(layout)
            staged = self._stager.stage(flat.tensors) if self.async_save else None
        except BaseException as exc:
            # The other ranks are about to wait for us in the first collective of
            # their write: join it with our error so that they fail too, not hang.
            coord.agree_name(lambda: "", exc, group, f"preparing the step {step} checkpoint")
            raise
        blocking_s = time.monotonic() - started
        round_number = self._round_of()  # the round whose state this is, not the write's

        tensors = staged.tensors if staged is not None else flat.tensors

        def job() -> CheckpointInfo:
            if staged is not None:
                staged.wait_copied()  # copies from a GPU land before the write reads them
            return self._write(step, tensors, objects, layout, extra, group, blocking_s,
                               round_number)

        if self.async_save:
            self._writer.submit(job)
        else:
            self._unclaimed = job()

    def wait(self) -> CheckpointInfo | None:
        """Block until the save in flight is committed; return it.

        Returns None when no save happened since the last call (a synchronous
        save's info is returned by the first call after it).

        Raises:
            CheckpointError: the save failed (on this or another rank).
        """
        info, self._unclaimed = self._unclaimed, None
        return self._writer.wait() or info  # type: ignore[return-value]

    def load(self, state: dict[str, Any], *, name: str | None = None,
             process_group: Any = None) -> CheckpointInfo:
        """Load a checkpoint into ``state`` in place, resharded to its sharding.

        With ``name=None`` the newest committed checkpoint is loaded, and if it is
        corrupt the one before it (logged and reported as an event).

        Raises:
            CheckpointLocationError: the bucket or folder does not exist (a missing
                local folder whose parent exists is a new, empty run).
            StorageUnreachableError: the storage endpoint does not answer.
            CheckpointNotFoundError: no committed checkpoint (or no ``name``) exists.
            CorruptShardError: a file is missing or damaged (every candidate, or ``name``).
            CheckpointMismatchError: the checkpoint does not fit ``state``.
        """
        self._drain_for_load()
        group = self._side_group(process_group)
        flat, local = coord.agree(lambda: (flatten(state), self._candidates(name, group)), group,
                                  "listing checkpoints")
        names, pointer = coord.broadcast(local, group)
        failed: builtins.list[str] = []
        last_error: CorruptShardError | None = None
        for candidate in names:
            try:
                info = self._load_one(candidate, flat, group)
                if info is None and candidate == pointer:
                    raise CorruptShardError(f"the committed checkpoint {candidate} has lost its "
                                            "manifest")
            except CorruptShardError as exc:
                self._known_bad.add(candidate)
                if name is not None:
                    raise
                logger.warning("checkpoint %s is corrupt (%s); falling back to an older one",
                               candidate, exc)
                failed.append(candidate)
                last_error = exc
                continue
            if info is None:
                continue  # no manifest: a save that never committed, not a checkpoint
            self._generation = max(self._generation, info.generation)
            self._emit("checkpoint.restored", info.step, self._round_of(), checkpoint=info.name,
                       fallback_from=failed)
            return info
        if last_error is not None:
            raise last_error  # every committed checkpoint is damaged; this is the oldest
        raise CheckpointNotFoundError(f"no committed checkpoint at {self.url}"
                                      + (f" named {name}" if name else ""))

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint folder, committed, partial or damaged, oldest first.

        Raises:
            CheckpointLocationError, StorageUnreachableError: see :meth:`load`.
        """
        self._storage.check_location(allow_new_run=True)
        dirs = scan(self._storage)
        committed = set(committed_names(dirs, self._pointer_name()))
        return [self._info(d, d.name in committed) for d in dirs]

    def bind(self, *, pointer: PointerStore | None = None, events: EventSink | None = None,
             collective_timeout: timedelta | None = None,
             round_of: Callable[[], int | None] | None = None) -> None:
        """Attach the run's fenced pointer, event sink, collective timeout and round.

        The elastic loop calls this: the user builds the Checkpointer before any
        round exists, and only the loop knows the round whose token fences commits,
        how long a save may wait for a peer that might be dead, and which round
        (``round_of()``) the events belong to.
        """
        self._pointer = pointer or self._pointer
        self._events = events or self._events
        self._round_of = round_of or self._round_of
        if collective_timeout is not None:
            self._timeout = collective_timeout

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and stop the writer thread."""
        try:
            self.wait()
        finally:
            self._writer.close()
            self._drop_side_group()

    # -- saving (runs in the background thread when async) --------------------------

    def _write(self, step: int, tensors: dict[str, torch.Tensor], objects: dict[str, Any],
               layout: dict | None, extra: dict, group: Any, blocking_s: float,
               round_number: int | None) -> CheckpointInfo:
        started = time.monotonic()
        name = coord.agree_name(lambda: self._new_name(step), None, group,
                                f"preparing the step {step} checkpoint")
        generation = parse_name(name)[1]  # type: ignore[index]  # ours: always parses
        self._generation = max(self._generation, generation)
        logger.info("writing checkpoint %s", self._storage.url_of(name))
        records = coord.agree(lambda: write_shards(tensors, self._storage, name, group), group,
                              f"saving {name}")
        parts = coord.all_gather((records, objects), group)
        manifest = Manifest(name=name, step=step, generation=generation, layout=layout,
                            extra=extra,
                            files=_merge_files(parts), objects=_merge_objects(parts),
                            world_size=len(parts), torch_version=torch.__version__)
        coord.agree(lambda: self._commit(manifest, group), group, f"committing {name}")
        info = CheckpointInfo.of(manifest, self._storage.url_of(name))
        write_s = time.monotonic() - started
        logger.info("committed checkpoint %s (%d bytes in %.2fs)", info.url, info.nbytes, write_s)
        if coord.rank_of(group) == 0:
            self._emit("checkpoint.committed", step, round_number, checkpoint=name,
                       nbytes=info.nbytes,
                       blocking_ms=round(blocking_s * 1000, 1), write_ms=round(write_s * 1000, 1))
            self._retain(committed=name)
        return info

    def _new_name(self, step: int) -> str:
        """Rank 0: a folder name whose generation is past everything in storage."""
        return new_name(step, next_generation(self._storage.list_dirs(), self._generation))

    def _commit(self, manifest: Manifest, group: Any) -> None:
        if coord.rank_of(group) != 0:
            return
        self._check_still_there(manifest)
        write_manifest(self._storage, manifest)
        if self._pointer is not None:
            self._pointer.commit(manifest.name)

    def _check_still_there(self, manifest: Manifest) -> None:
        """Every rank's files are where they were written, or the save fails: another
        process may have removed the folder, and a manifest alone is no checkpoint."""
        found = self._storage.list_files(manifest.name)
        lost = [f.path for f in manifest.files if found.get(f.path) != f.size]
        if lost:
            raise CheckpointError(
                f"{self._storage.url_of(manifest.name)} lost {len(lost)} of its "
                f"{len(manifest.files)} files while it was being saved (first: {lost[0]}); "
                "another process removed them, so it was not committed")

    def _retain(self, committed: str) -> None:
        def loadable(name: str) -> bool:
            if name == committed:
                return True
            try:
                return (name not in self._known_bad
                        and read_manifest(self._storage, name, missing_ok=True) is not None)
            except CorruptShardError:
                return False

        def settled(name: str) -> bool:
            if self._storage.exists(f"{name}/{MANIFEST_FILE}"):
                return True  # a manifest is the last thing a writer writes
            changed = self._storage.last_change(name)
            return changed is None or time.time() - changed > PARTIAL_GRACE_S

        try:
            doomed = names_to_remove(self._storage.list_dirs(), self._pointer_name(), self.keep,
                                     {committed}, loadable, settled)
            for name in doomed:
                logger.info("retention removes %s", self._storage.url_of(name))
                self._storage.remove_tree(name)
        except Exception as exc:  # retention is housekeeping: the commit already happened
            logger.warning("retention under %s failed: %s", self.url, exc)

    # -- loading ---------------------------------------------------------------------

    def _drain_for_load(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # a save that failed does not stop a restore
            logger.warning("the checkpoint save in flight failed before the load: %s", exc)

    def _candidates(self, name: str | None,
                    group: Any) -> tuple[builtins.list[str], str | None]:
        """Rank 0: the folders to try, newest first, and the pointer they were read under.

        One listing of the run's folder; whether a folder holds a manifest is found
        out by reading it when its turn comes (on an object store, a listing per folder
        would cost a request each, every restore).
        """
        if coord.rank_of(group) != 0:
            return [], None
        self._storage.check_location(allow_new_run=True)
        names = self._storage.list_dirs()
        if name is not None:
            return ([name] if name in names else []), None
        pointer = self._pointer_name()
        return candidates(names, pointer), pointer

    def _load_one(self, name: str, flat: FlatState, group: Any) -> CheckpointInfo | None:
        """Load ``name`` (collective); None when it has no manifest (a partial save)."""
        url = self._storage.url_of(name)

        def prepare() -> Header | None:
            header = read_header(self._storage, name)
            if header is not None:
                check_fits(flat.tensors, header.metadata, url)
                flat.check_objects(header.manifest.objects, url)
            return header

        header = coord.agree(prepare, group, f"reading {name}")
        if header is None:
            return None
        manifest = header.manifest
        read_shards(flat.tensors, self._storage, header, group)
        flat.finish_load(manifest.objects, url)
        logger.info("restored checkpoint %s", url)
        return CheckpointInfo.of(manifest, url)

    # -- helpers ---------------------------------------------------------------------

    def _pointer_name(self) -> str | None:
        return self._pointer.read() if self._pointer is not None else None

    def _info(self, state: DirState, committed: bool) -> CheckpointInfo:
        url = self._storage.url_of(state.name)
        step, generation = parse_name(state.name) or (0, 0)
        problem = None
        if state.has_manifest:
            try:
                manifest = read_manifest(self._storage, state.name, missing_ok=True)
            except CorruptShardError as exc:
                problem = str(exc)
            else:
                if manifest is not None:  # else removed since the listing
                    return CheckpointInfo.of(manifest, url, committed)
        return CheckpointInfo(state.name, step, url, None, {}, False, state.nbytes,
                              generation=generation, problem=problem)

    def _side_group(self, process_group: Any) -> Any:
        """Our own gloo group over the ranks of ``process_group`` (None: one process)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        training = process_group if process_group is not None else dist.group.WORLD
        if self._side is not None and self._side[0] is training:
            return self._side[1]
        self._drop_side_group()
        side = side_group(training, self._timeout)
        self._side = (training, side)
        return side

    def _drop_side_group(self) -> None:
        side, self._side = self._side, None
        if side is not None:
            destroy_side_group(side[1])

    def _emit(self, event: str, step: int, round_number: int | None, **metadata: Any) -> None:
        if self._events is not None:
            self._events.emit(event, round=round_number, step=step, **metadata)


def _checked_extra(extra: dict | None) -> dict:
    try:
        return json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint extra= is not JSON-able: {exc}",
                          "Pass only str, int, float, bool, None, lists and dicts.") from exc


def _checked_layout(layout: dict | None) -> dict | None:
    """The layout as the manifest stores it: axis names to sizes (anything else would
    make the checkpoint unreadable as corrupt)."""
    if layout is not None and not (isinstance(layout, dict) and all(
            isinstance(k, str) and type(v) is int and v > 0 for k, v in layout.items())):
        raise ConfigError(f"checkpoint layout={layout!r} is not a map of axis names to sizes",
                          "Pass layout.to_dict(), e.g. {'dp': 2, 'pp': 1, 'tp': 1}.")
    return layout


def _merge_files(parts: list[tuple[dict[str, FileEntry], dict]]) -> tuple[FileEntry, ...]:
    files: dict[str, FileEntry] = {}
    for records, _ in parts:
        files.update(records)
    return tuple(sorted(files.values(), key=lambda f: f.path))


def _merge_objects(parts: list[tuple[dict, dict[str, Any]]]) -> dict[str, Any]:
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
