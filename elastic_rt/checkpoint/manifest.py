"""The JSON manifest that commits a checkpoint, and discovery and retention over them.

A checkpoint is a folder ``step-<8 digit step>-<6 hex>`` under the run's URL. The
manifest (``manifest.json``) is written last, after every rank's files are durable;
it lists every file with its size and checksum (:mod:`.checksum`), the layout, the
step, the user's ``extra`` and the non-tensor state. A folder without a manifest is a partial
checkpoint: never loaded, and removed by retention.

With a pointer (the run's fenced "latest committed" name in etcd) a manifest is not
enough: a checkpoint is committed when it is the pointer's or older than it. This
keeps a manifest written by a fenced-out round, or one whose pointer update crashed,
invisible. The decisions (:func:`candidates`, :func:`committed_names`,
:func:`names_to_remove`) are pure functions over folder names; the I/O is in
:func:`scan`, :func:`read_manifest` and :func:`write_manifest`.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_rt.checkpoint.storage import Storage
from elastic_rt.errors import CorruptShardError

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_NAME_RE = re.compile(r"^step-(\d{8})-([0-9a-f]{6})$")


def new_name(step: int) -> str:
    """A fresh checkpoint folder name; the random part keeps retries apart."""
    return f"step-{step:08d}-{secrets.token_hex(3)}"


def parse_step(name: str) -> int | None:
    """The step in a checkpoint folder name, or None if it is not one of ours."""
    match = _NAME_RE.match(name)
    return int(match.group(1)) if match else None


def _order(name: str) -> tuple[int, str]:
    return (parse_step(name) or 0, name)


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint, relative to its folder."""

    path: str
    size: int
    checksum: str
    """Of the whole file, as ``"<algorithm>:<hex>"`` (corruption check, not a signature)."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a committed checkpoint holds. Written last; its presence is the commit."""

    name: str
    step: int
    files: tuple[FileEntry, ...]
    layout: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    """Non-tensor state leaves by key, in the tagged JSON of :mod:`.state_tree`."""
    world_size: int = 1
    torch_version: str = ""
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    format_version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str) -> "Manifest":
        """Parse a manifest; anything unexpected is a corrupt checkpoint.

        Version 1 manifests (CRC-32 as ``crc32``) are read as version 2.

        Raises:
            CorruptShardError: not JSON, unknown version or missing fields.
        """
        try:
            raw = json.loads(data)
            if raw.get("format_version") not in _READABLE_VERSIONS:
                raise ValueError(f"format_version {raw.get('format_version')!r}")
            if raw["format_version"] == 1:
                for entry in raw["files"]:
                    entry["checksum"] = f"crc32:{entry.pop('crc32')}"
                raw["format_version"] = FORMAT_VERSION
            raw["files"] = tuple(FileEntry(**f) for f in raw["files"])
            return cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptShardError(f"{source} is not a valid checkpoint manifest: {exc}") from exc


@dataclass(frozen=True, slots=True)
class DirState:
    """A checkpoint folder as a listing shows it."""

    name: str
    has_manifest: bool
    nbytes: int


def candidates(names: Iterable[str], pointer: str | None) -> list[str]:
    """Folders that are committed if they hold a manifest, newest first: ours, and
    with a pointer, the pointer's or older."""
    ours = sorted((n for n in names if parse_step(n) is not None), key=_order, reverse=True)
    if pointer is None:
        return ours
    limit = parse_step(pointer)
    if limit is None:
        return []
    return [n for n in ours if n == pointer or (parse_step(n) or 0) < limit]


def committed_names(dirs: list[DirState], pointer: str | None) -> list[str]:
    """Committed checkpoints, oldest first (see the module docstring for the rule)."""
    with_manifest = {d.name for d in dirs if d.has_manifest}
    return [n for n in reversed(candidates(with_manifest, pointer))]


def names_to_remove(names: Iterable[str], pointer: str | None, keep: int, in_flight: set[str],
                    has_manifest: Callable[[str], bool]) -> list[str]:
    """Folders retention deletes, oldest first: committed ones beyond the newest
    ``keep``, and every uncommitted folder that is not being written now. ``keep <= 0``
    keeps all committed.

    ``has_manifest`` is asked only about the newest candidates, until ``keep`` are
    found: on an object store each answer is a request.
    """
    names = [n for n in names if parse_step(n) is not None]
    kept: list[str] = []
    for name in candidates(names, pointer):
        if keep > 0 and len(kept) == keep:
            break
        if has_manifest(name):
            kept.append(name)
    return sorted((n for n in names if n not in kept and n not in in_flight), key=_order)


def scan(storage: Storage) -> list[DirState]:
    """Every checkpoint folder under the storage root, oldest first."""
    states = []
    for name in storage.list_dirs():
        if parse_step(name) is None:
            continue
        files = storage.list_files(name)
        states.append(DirState(name, MANIFEST_FILE in files, sum(files.values())))
    return sorted(states, key=lambda d: _order(d.name))


def read_manifest(storage: Storage, name: str, *, missing_ok: bool = False) -> Manifest | None:
    """Read and parse one checkpoint's manifest (None if missing and ``missing_ok``).

    Raises:
        CorruptShardError: the manifest is missing (unless ``missing_ok``) or unreadable.
    """
    source = storage.url_of(f"{name}/{MANIFEST_FILE}")
    try:
        data = storage.read_bytes(f"{name}/{MANIFEST_FILE}", nonempty=True)  # never written empty
    except FileNotFoundError as exc:
        if missing_ok:
            return None
        raise CorruptShardError(f"{source} is missing") from exc
    manifest = Manifest.from_json(data, source)
    if manifest.name != name:
        raise CorruptShardError(f"{source} names another checkpoint ({manifest.name})")
    return manifest


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Write the manifest: the last file of a checkpoint, atomically."""
    storage.write_bytes(f"{manifest.name}/{MANIFEST_FILE}", manifest.to_json())
