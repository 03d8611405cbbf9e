"""The Checkpointer: sharded, atomic, asynchronous checkpoints on an fsspec URL.

Every save goes to a fresh folder ``<url>/step-<step>-g<generation>-<6 hex>/``, never
over an old one (an interrupted overwrite would mix two steps); its generation is past
every folder in storage and the checkpoint this process restored, so the newest
commit is the newest in :func:`~.manifest.order_key` order. Every rank writes its own
shards through DCP; rank 0 checks that they are all still there, then writes the JSON
manifest (the last file) and, when a pointer is given, commits the name in the run's
fenced pointer, judged by the round the state was saved in (``save(fence=...)``).
Only then is the checkpoint committed and visible to :meth:`Checkpointer.load`.
Commit and retention: ``checkpoint/commit.py``.

A user builds a ``Checkpointer(url, every_steps=..., keep=...)`` before any round
exists; it saves and loads on its own. The elastic loop trains with
:meth:`Checkpointer.for_run`, a new checkpointer on the same URL and settings that also
knows the run's pointer, event sink and collective timeout.

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
from elastic_rt.checkpoint.commit import commit, merge_files, merge_objects, retain
from elastic_rt.checkpoint.manifest import (
    DirState,
    FileEntry,
    Manifest,
    candidates,
    committed_names,
    new_name,
    next_generation,
    parse_name,
    read_manifest,
    scan,
)
from elastic_rt.checkpoint.pointer import Fence, PointerStore
from elastic_rt.checkpoint.sharded import (
    Header,
    check_fits,
    read_header,
    read_shards,
    write_shards,
)
from elastic_rt.checkpoint.state_tree import FlatState, encode_objects, flatten
from elastic_rt.checkpoint.storage import FsspecStorage
from elastic_rt.errors import CheckpointNotFoundError, ConfigError, CorruptShardError
from elastic_rt.events import EventSink
from elastic_rt.process_groups import destroy_side_group, side_group

logger = logging.getLogger(__name__)


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
        round_of: the round a load runs in, for its event; a save's comes with it.

    Raises:
        UnknownURLSchemeError: the URL's scheme is not supported.
        ConfigError: ``every_steps`` or ``keep`` is negative.
    """

    def __init__(self, url: str, *, every_steps: int = 0, keep: int = 3, async_save: bool = True,
                 storage_options: dict | None = None, pointer: PointerStore | None = None,
                 events: EventSink | None = None,
                 collective_timeout: timedelta = timedelta(minutes=10),
                 round_of: Callable[[], int | None] = lambda: None) -> None:
        for field_name, value in (("every_steps", every_steps), ("keep", keep)):
            if value < 0:
                raise ConfigError(f"Checkpointer {field_name}={value} is negative",
                                  f"Pass {field_name}=0 or more.")
        self.url = url.rstrip("/")
        self.every_steps = every_steps
        self.keep = keep
        self.async_save = async_save
        self._storage_options = storage_options  # for for_run(); never logged
        self._storage = FsspecStorage(url, storage_options)
        self._pointer = pointer
        self._events = events
        self._timeout = collective_timeout
        self._stager = Stager()
        self._staging_reserved = False
        self._writer = BackgroundWriter()
        self._side: tuple[Any, Any] | None = None
        self._round_of = round_of
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

    def for_run(self, *, pointer: PointerStore | None, events: EventSink,
                collective_timeout: timedelta,
                round_of: Callable[[], int | None]) -> Checkpointer:
        """A new checkpointer on this one's URL and settings, for the elastic loop; it
        takes this one's staging buffers (those :meth:`reserve_staging` made in a standby
        worker before the run's keys were known), and this one starts without any.

        Args:
            pointer: the run's fenced pointer (None: the manifest alone commits).
            events: where ``checkpoint.committed`` / ``checkpoint.restored`` go.
            collective_timeout: how long a save may wait for a peer that may be dead.
            round_of: the round a load runs in, for its event (a load is synchronous:
                it runs in the round that asks for it); a save's round comes with it
                (``save(fence=...)``), since its commit may land in a later round.
        """
        run = Checkpointer(self.url, every_steps=self.every_steps, keep=self.keep,
                           async_save=self.async_save, storage_options=self._storage_options,
                           pointer=pointer, events=events,
                           collective_timeout=collective_timeout, round_of=round_of)
        run._stager, run._staging_reserved = self._stager, self._staging_reserved
        self._stager, self._staging_reserved = Stager(), False
        return run

    def save(self, step: int, state: dict[str, Any], *, layout: dict | None = None,
             extra: dict | None = None, process_group: Any = None,
             fence: Fence | None = None) -> None:
        """Checkpoint ``state`` at ``step``; collective over ``process_group``.

        Waits for the previous save first. With ``async_save`` it returns once the
        tensors are staged in CPU memory; :meth:`wait` gives the outcome. ``fence``
        is the round ``state`` belongs to: its events carry the round, and the
        pointer's commit is judged by its token, whenever the write ends.

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
        round_number = fence.round if fence is not None else self._round_of()
        tensors = staged.tensors if staged is not None else flat.tensors

        def job() -> CheckpointInfo:
            if staged is not None:
                staged.wait_copied()  # copies from a GPU land before the write reads them
            return self._write(step, tensors, objects, layout, extra, group, blocking_s,
                               round_number, fence)

        if self.async_save:
            self._writer.submit(job)
        else:
            self._unclaimed = job()

    def reserve_staging(self, state: Callable[[], dict[str, Any]], *,
                        background: bool = True) -> bool:
        """Make the first async save's staging buffers for ``state()`` now, in the
        background unless ``background`` is False (:meth:`Stager.reserve`: the first save
        no longer faults a state's size of fresh memory in the training thread); whether
        it started. Once per checkpointer (``state`` is called only then): later layouts'
        buffers are made by the save that needs them, as before.
        """
        if not self.async_save or self.every_steps == 0 or self._staging_reserved:
            return False
        self._staging_reserved = True
        return self._stager.reserve(flatten(state()).tensors, background=background)

    @property
    def is_writing(self) -> bool:
        """Whether an async save is still being written (its collectives still to come)."""
        return self._writer.is_busy

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
        started = time.monotonic()
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
                       fallback_from=failed, nbytes=info.nbytes,
                       duration_ms=round((time.monotonic() - started) * 1000, 1))
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
               round_number: int | None, fence: Fence | None) -> CheckpointInfo:
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
                            files=merge_files(parts), objects=merge_objects(parts),
                            world_size=len(parts), torch_version=torch.__version__)
        coord.agree(lambda: self._commit(manifest, group, fence), group, f"committing {name}")
        info = CheckpointInfo.of(manifest, self._storage.url_of(name))
        write_s = time.monotonic() - started
        logger.info("committed checkpoint %s (%d bytes in %.2fs)", info.url, info.nbytes, write_s)
        if coord.rank_of(group) == 0:
            self._emit("checkpoint.committed", step, round_number, checkpoint=name,
                       nbytes=info.nbytes,
                       blocking_ms=round(blocking_s * 1000, 1), write_ms=round(write_s * 1000, 1))
            retain(self._storage, committed=name, pointer_name=self._pointer_name(),
                   keep=self.keep, known_bad=self._known_bad)
        return info

    def _new_name(self, step: int) -> str:
        """Rank 0: a folder name whose generation is past everything in storage."""
        return new_name(step, next_generation(self._storage.list_dirs(), self._generation))

    def _commit(self, manifest: Manifest, group: Any, fence: Fence | None) -> None:
        if coord.rank_of(group) == 0:
            commit(self._storage, manifest, self._pointer, fence)

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
