"""The JSON manifest that commits a checkpoint, and the order of checkpoints.

A checkpoint is a folder ``step-<8 digit step>-g<6 digit generation>-<6 hex>`` under
the run's URL (before generations: ``step-<8 digits>-<6 hex>``, generation 0). The
manifest (``manifest.json``) is written last, after every rank's files are durable;
it lists every file with its size and checksum (:mod:`.checksum`), the layout, the
step, the generation, the user's ``extra`` and the non-tensor state, and ends with a
checksum of its own content. A folder without a manifest is a partial checkpoint:
never loaded.

**Order.** Checkpoints are ordered by (generation, step, name). Every save takes a
generation past every one in storage and the one it restored from, so the newest
commit wins even when an abandoned future with a higher step is still there
(restore step 10, save 15: the old step 20 stays behind), and ties between racing
writers are broken the same way by every reader.

**Commit.** With a pointer (the run's fenced "latest committed" name in etcd) a
manifest is not enough: a checkpoint is committed when it is the pointer's or older
than it. This keeps a manifest written by a fenced-out round, or one whose pointer
update crashed, invisible.

**One rule for damage.** Anything malformed, mistyped, unknown or inconsistent in a
manifest is a :class:`CorruptShardError`: the load falls back to the checkpoint
before. Every file path must be a plain name inside the folder (:func:`is_plain_file_name`).

The decisions (:func:`candidates`, :func:`committed_names`, :func:`names_to_remove`)
are pure functions over folder names; the I/O is in :func:`scan`,
:func:`read_manifest` and :func:`write_manifest`.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from elastic_rt.checkpoint.checksum import checksum_of, is_recorded_checksum
from elastic_rt.checkpoint.state_tree import check_encoded
from elastic_rt.checkpoint.storage import NOT_A_FILE, Storage
from elastic_rt.errors import CorruptShardError

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
"""Formats 1 and 2 (no generation, no manifest checksum) still load: they were
written before either existed. A new-style name implies format 3, so a current
checkpoint cannot be passed off as an older format (its generation would not match)."""
_OWN_CHECKSUM = "manifest_checksum"
_NAME_RE = re.compile(r"^step-(\d{8})-(?:g(\d{6})-)?([0-9a-f]{6})$")
_PLAIN_FILE_RE = re.compile(r"^(?:\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]{0,254})$")


def new_name(step: int, generation: int) -> str:
    """A fresh checkpoint folder name; the random part keeps retries apart."""
    return f"step-{step:08d}-g{generation:06d}-{secrets.token_hex(3)}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(step, generation) of a checkpoint folder name, or None if it is not one of ours."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def parse_step(name: str) -> int | None:
    """The step in a checkpoint folder name, or None if it is not one of ours."""
    parsed = parse_name(name)
    return parsed[0] if parsed else None


def order_key(name: str) -> tuple[int, int, str]:
    """Sort key of checkpoint names: (generation, step, name), newest last."""
    step, generation = parse_name(name) or (0, 0)
    return (generation, step, name)


def next_generation(names: Iterable[str], restored: int) -> int:
    """The generation of a new save: past every folder in storage and past ``restored``."""
    seen = [parsed[1] for n in names if (parsed := parse_name(n)) is not None]
    return max([restored, *seen]) + 1


def is_plain_file_name(path: object) -> bool:
    """Whether ``path`` names a file directly inside a checkpoint folder (no ``/``,
    no ``..``, no hidden name but DCP's ``.metadata``): confinement by construction."""
    return isinstance(path, str) and _PLAIN_FILE_RE.match(path) is not None


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
    generation: int = 0
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
        return sealed_json(asdict(self))

    @classmethod
    def from_json(cls, data: bytes, source: str) -> "Manifest":
        """Parse and check a manifest; anything unexpected is a corrupt checkpoint.

        The manifest's own checksum is checked first, then every field's type and
        range. Versions 1 and 2 (no checksum, no generation; version 1 with CRC-32 as
        ``crc32``) are read as generation 0.

        Raises:
            CorruptShardError: not JSON, a bad checksum, an unknown version or field,
                a missing or mistyped field, or a path outside the folder.
        """
        try:
            raw = json.loads(data, object_pairs_hook=_unique_keys)
            if not isinstance(raw, dict):
                raise ValueError(f"a JSON {type(raw).__name__}, not an object")
            version = raw.get("format_version")
            if type(version) is not int or version not in _READABLE_VERSIONS:
                raise ValueError(f"unknown format_version {version!r}")
            if version == FORMAT_VERSION:
                _check_own_checksum(raw)
            else:
                _upgrade(raw)
            return _checked(raw)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise CorruptShardError(f"{source} is not a valid checkpoint manifest: {exc}") from exc


def sealed_json(body: dict[str, Any]) -> bytes:
    """``body`` as manifest bytes, with the checksum over its own content (any old one
    replaced). Not a signature: whoever can write storage can call this too."""
    sealed = {**body, _OWN_CHECKSUM: checksum_of(_canonical(body))}
    return json.dumps(sealed, sort_keys=True, indent=1).encode()


def _canonical(body: dict[str, Any]) -> bytes:
    """The bytes the manifest checksum covers: every field but the checksum, sorted,
    compact; what a reader rebuilds from the parsed JSON, whatever the file's spacing."""
    rest = {k: v for k, v in body.items() if k != _OWN_CHECKSUM}
    return json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a repeated key among {sorted(keys)}")
    return dict(pairs)


def _check_own_checksum(raw: dict[str, Any]) -> None:
    recorded = raw.get(_OWN_CHECKSUM)
    if not (isinstance(recorded, str) and recorded.startswith("xxh3_64:")
            and is_recorded_checksum(recorded)):
        raise ValueError(f"{_OWN_CHECKSUM} is missing or malformed: {recorded!r}")
    actual = checksum_of(_canonical(raw), like=recorded)
    if actual != recorded:
        raise ValueError(f"its content does not match its checksum ({actual}, recorded "
                         f"{recorded}): it was changed after it was written")
    del raw[_OWN_CHECKSUM]


def _upgrade(raw: dict[str, Any]) -> None:
    """Versions 1 and 2 in today's shape (their names carry no generation)."""
    if raw["format_version"] == 1:
        for entry in _typed(raw, "files", list):
            if not isinstance(entry, dict) or "crc32" not in entry:
                raise ValueError("a version 1 file entry without crc32")
            entry["checksum"] = f"crc32:{entry.pop('crc32')}"
    if "generation" in raw:
        raise ValueError("a generation in a format without generations")
    raw["format_version"] = FORMAT_VERSION


_FIELDS = frozenset(f.name for f in fields(Manifest))
_REQUIRED = frozenset({"name", "step", "files"})


def _checked(raw: dict[str, Any]) -> Manifest:
    unknown = sorted(set(raw) - _FIELDS)
    missing = sorted(_REQUIRED - set(raw))
    if unknown or missing:
        raise ValueError(f"unknown fields {unknown}" if unknown else f"missing fields {missing}")
    parsed = parse_name(_typed(raw, "name", str))
    if parsed is None:
        raise ValueError(f"name {raw['name']!r} is not a checkpoint folder name")
    step = _count(raw, "step")
    generation = _count(raw, "generation") if "generation" in raw else 0
    if (step, generation) != parsed:
        raise ValueError(f"step {step} and generation {generation} disagree with the name "
                         f"{raw['name']!r}")
    layout = raw.get("layout")
    if layout is not None and not (isinstance(layout, dict) and all(
            isinstance(k, str) and type(v) is int and v > 0 for k, v in layout.items())):
        raise ValueError(f"layout {layout!r} is not a map of axis names to sizes")
    for key in ("extra", "objects"):
        _typed(raw, key, dict, optional=True)
    for key, value in raw.get("objects", {}).items():
        check_encoded(value, key)
    if "world_size" in raw and _count(raw, "world_size") < 1:
        raise ValueError("world_size is below 1")
    for key in ("created_ms",):
        if key in raw:
            _count(raw, key)
    _typed(raw, "torch_version", str, optional=True)
    return Manifest(**{**raw, "files": _files(_typed(raw, "files", list))})


def _files(entries: list[Any]) -> tuple[FileEntry, ...]:
    files: dict[str, FileEntry] = {}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "checksum"}:
            raise ValueError(f"file entry {entry!r} is not exactly path, size and checksum")
        path, size, checksum = entry["path"], entry["size"], entry["checksum"]
        if not is_plain_file_name(path):
            raise ValueError(f"file path {path!r} is not a plain name inside the folder")
        if type(size) is not int or size < 0:
            raise ValueError(f"file {path!r} has the size {size!r}")
        if not is_recorded_checksum(checksum):
            raise ValueError(f"file {path!r} has the checksum {checksum!r}")
        if path in files:
            raise ValueError(f"file {path!r} is listed twice")
        files[path] = FileEntry(path, size, checksum)
    return tuple(files.values())


def _typed(raw: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    if optional and key not in raw:
        return None
    value = raw[key]
    if not isinstance(value, kind):
        raise ValueError(f"{key} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _count(raw: dict[str, Any], key: str) -> int:
    value = raw[key]
    if type(value) is not int or value < 0:
        raise ValueError(f"{key} {value!r} is not a whole number")
    return value


@dataclass(frozen=True, slots=True)
class DirState:
    """A checkpoint folder as a listing shows it."""

    name: str
    has_manifest: bool
    nbytes: int


def candidates(names: Iterable[str], pointer: str | None) -> list[str]:
    """Folders that are committed if they hold a manifest, newest first: ours, and
    with a pointer, the pointer's or older (in :func:`order_key` order)."""
    ours = sorted((n for n in names if parse_name(n) is not None), key=order_key, reverse=True)
    if pointer is None:
        return ours
    if parse_name(pointer) is None:
        return []
    limit = order_key(pointer)
    return [n for n in ours if order_key(n) <= limit]


def committed_names(dirs: list[DirState], pointer: str | None) -> list[str]:
    """Committed checkpoints, oldest first (see the module docstring for the rule)."""
    with_manifest = {d.name for d in dirs if d.has_manifest}
    return [n for n in reversed(candidates(with_manifest, pointer))]


def names_to_remove(names: Iterable[str], pointer: str | None, keep: int,
                    protected: set[str], loadable: Callable[[str], bool],
                    settled: Callable[[str], bool]) -> list[str]:
    """Folders retention deletes, oldest first.

    Kept: the newest ``keep`` *loadable* committed checkpoints (``keep <= 0``: all),
    so a damaged folder never takes a loadable one's place, and ``protected`` ones
    (this process's save in flight). Every other folder of ours is deleted only when
    ``settled`` says no writer can still be filling it (it holds a manifest, or
    nothing in it changed for a while); a folder newer than the pointer is deleted
    only when settled too, since its writer may be about to commit.

    ``loadable`` is asked only about the newest candidates, until ``keep`` are found:
    on an object store each answer is a request.
    """
    names = [n for n in names if parse_name(n) is not None]
    kept: list[str] = []
    for name in candidates(names, pointer):
        if keep > 0 and len(kept) == keep:
            break
        if loadable(name):
            kept.append(name)
    rest = [n for n in names if n not in kept and n not in protected]
    return sorted((n for n in rest if settled(n)), key=order_key)


def scan(storage: Storage) -> list[DirState]:
    """Every checkpoint folder under the storage root, oldest first."""
    states = []
    for name in storage.list_dirs():
        if parse_name(name) is None:
            continue
        files = storage.list_files(name)
        states.append(DirState(name, MANIFEST_FILE in files, sum(files.values())))
    return sorted(states, key=lambda d: order_key(d.name))


def read_manifest(storage: Storage, name: str, *, missing_ok: bool = False) -> Manifest | None:
    """Read and check one checkpoint's manifest (None if missing and ``missing_ok``).

    Raises:
        CorruptShardError: the manifest is missing (unless ``missing_ok``), not a file,
            or invalid (:meth:`Manifest.from_json`), or names another folder.
    """
    source = storage.url_of(f"{name}/{MANIFEST_FILE}")
    try:
        data = storage.read_bytes(f"{name}/{MANIFEST_FILE}", nonempty=True)  # never written empty
    except FileNotFoundError as exc:
        if missing_ok:
            return None
        raise CorruptShardError(f"{source} is missing") from exc
    except NOT_A_FILE as exc:
        raise CorruptShardError(f"{source} is not a file") from exc
    manifest = Manifest.from_json(data, source)
    if manifest.name != name:
        raise CorruptShardError(f"{source} names another checkpoint ({manifest.name})")
    return manifest


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Write the manifest: the last file of a checkpoint, atomically."""
    storage.write_bytes(f"{manifest.name}/{MANIFEST_FILE}", manifest.to_json())
