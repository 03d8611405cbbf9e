"""``elastic-rt checkpoint ls|verify URL``: look at checkpoints without loading them.

``ls`` prints one line per checkpoint folder (a damaged manifest shows as CORRUPT).
``verify`` checks what a load checks -- the manifest and its own checksum, DCP's
metadata against the manifest, every file's size and checksum -- for every folder
with a manifest; it runs no pickle and needs no process group. A missing location is
an error for both, not an empty listing.
"""

from __future__ import annotations

from typing import Any

from elastic_rt.checkpoint.checksum import checksum_of
from elastic_rt.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from elastic_rt.checkpoint.manifest import FileEntry
from elastic_rt.checkpoint.sharded import METADATA_FILE, read_header
from elastic_rt.checkpoint.storage import NOT_A_FILE, FsspecStorage
from elastic_rt.errors import CorruptShardError


def ls(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """One line per checkpoint, oldest first: name, step, layout, size, state.

    Raises:
        UnknownURLSchemeError, CredentialsError: bad URL or credentials.
        CheckpointLocationError, StorageUnreachableError: the location is missing or
            cannot be reached.
    """
    return [_line(info) for info in Checkpointer(url, storage_options=storage_options).list()]


def _line(info: CheckpointInfo) -> str:
    layout = _layout_text(info.layout)
    state = "committed" if info.committed else "partial"
    if info.problem:
        state = f"CORRUPT: {info.problem}"
    return f"{info.name}  step={info.step}  layout={layout}  size={_size(info.nbytes)}  {state}"


def _layout_text(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "-"
    return "x".join(f"{axis}{layout[axis]}" for axis in ("dp", "pp", "tp") if axis in layout) or (
        ",".join(f"{k}={v}" for k, v in sorted(layout.items())))


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def verify(url: str, storage_options: dict[str, Any] | None = None) -> tuple[bool, list[str]]:
    """Check every checkpoint that has a manifest: the manifest itself, DCP's metadata
    against it, and every file's size and checksum -- what a load would check.

    Returns:
        (all good, one line per checkpoint and per problem). A damaged manifest is
        a problem, not a partial save.

    Raises:
        UnknownURLSchemeError, CredentialsError: bad URL or credentials.
        CheckpointLocationError, StorageUnreachableError: the location is missing or
            cannot be reached.
    """
    storage = FsspecStorage(url, storage_options)
    infos = [i for i in Checkpointer(url, storage_options=storage_options).list()
             if i.committed or i.problem]
    lines: list[str] = []
    ok = True
    for info in infos:
        problems = [info.problem] if info.problem else _problems(storage, info)
        ok = ok and not problems
        lines.append(f"{info.name}  {'ok' if not problems else 'CORRUPT'}  "
                     f"({len(info.files)} files, {_size(info.nbytes)})")
        lines.extend(f"  {p}" for p in problems)
    if not infos:
        lines.append(f"no committed checkpoint under {url}")
    return ok, lines


def _problems(storage: FsspecStorage, info: CheckpointInfo) -> list[str]:
    try:
        read_header(storage, info.name)  # manifest, .metadata and their consistency
    except CorruptShardError as exc:
        return [str(exc)]
    return [p for f in info.files if f.path != METADATA_FILE
            if (p := _check_file(storage, info.name, f))]


def _check_file(storage: FsspecStorage, name: str, entry: FileEntry) -> str | None:
    rel = f"{name}/{entry.path}"
    try:
        data = storage.read_bytes(rel, nonempty=entry.size > 0)
    except NOT_A_FILE:
        return f"{storage.url_of(rel)}: missing or not a file"
    checksum = checksum_of(data, entry.checksum)
    if (len(data), checksum) != (entry.size, entry.checksum):
        return (f"{storage.url_of(rel)}: {len(data)} bytes, checksum {checksum}; manifest "
                f"says {entry.size} bytes, {entry.checksum}")
    return None
