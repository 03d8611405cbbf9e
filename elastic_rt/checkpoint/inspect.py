"""``elastic-rt checkpoint ls|verify URL``: look at checkpoints without loading them.

``ls`` prints one line per checkpoint folder (a damaged manifest shows as CORRUPT).
``verify`` checks what a load checks -- the manifest and its own checksum, DCP's
metadata against the manifest, every file's size and checksum, every tensor item
decoded as a load would -- for every folder with a manifest; it runs no pickle and needs
no process group. A missing location is
an error for both, not an empty listing (even a new run folder: nothing has been
saved there yet, so a missing one is a typo).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from elastic_rt.checkpoint.checksum import checksum_of
from elastic_rt.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from elastic_rt.checkpoint.manifest import FileEntry
from elastic_rt.checkpoint.sharded import METADATA_FILE, read_header
from elastic_rt.checkpoint.storage import NOT_A_FILE, FsspecStorage
from elastic_rt.checkpoint.verified_read import decode_item
from elastic_rt.errors import CorruptShardError


def ls(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """One line per checkpoint, oldest first: name, step, layout, size, state.

    Raises:
        UnknownURLSchemeError, CredentialsError: bad URL or credentials.
        CheckpointLocationError, StorageUnreachableError: the location is missing or
            cannot be reached.
    """
    FsspecStorage(url, storage_options).check_location(allow_new_run=False)
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
    return "x".join(f"{axis}{layout[axis]}" for axis in ("dp", "pp", "tp", "shard")
                    if axis in layout) or (
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
    storage.check_location(allow_new_run=False)
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
        header = read_header(storage, info.name)  # manifest, .metadata and their consistency
    except CorruptShardError as exc:
        return [str(exc)]
    if header is None:
        return [f"{storage.url_of(info.name)}: its manifest was removed while verifying"]
    items = _items_by_file(header.metadata)
    problems = []
    for entry in info.files:
        if entry.path == METADATA_FILE:
            continue
        source = storage.url_of(f"{info.name}/{entry.path}")
        data, problem = _read_checked(storage, f"{info.name}/{entry.path}", entry)
        problem = problem or _item_problem(memoryview(data), items.get(entry.path, []), source)
        if problem:
            problems.append(problem)
    return problems


def _read_checked(storage: FsspecStorage, rel: str, entry: FileEntry) -> tuple[bytes, str | None]:
    try:
        data = storage.read_bytes(rel, nonempty=entry.size > 0)
    except NOT_A_FILE:
        return b"", f"{storage.url_of(rel)}: missing or not a file"
    checksum = checksum_of(data, entry.checksum)
    if (len(data), checksum) != (entry.size, entry.checksum):
        return data, (f"{storage.url_of(rel)}: {len(data)} bytes, checksum {checksum}; "
                      f"manifest says {entry.size} bytes, {entry.checksum}")
    return data, None


_Item = tuple[str, int, int, tuple[int, ...]]
"""(key, offset, length, the chunk's shape) of one stored tensor item."""


def _items_by_file(metadata: Metadata) -> dict[str, list[_Item]]:
    """Every item in every file, with the shape the load expects of it."""
    shapes = {(fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
              for fqn, entry in metadata.state_dict_metadata.items()
              for chunk in entry.chunks}  # type: ignore[union-attr]  # checked: tensors only
    items: dict[str, list[_Item]] = {}
    for index, stored in metadata.storage_data.items():
        shape = shapes[(index.fqn, tuple(index.offset or ()))]
        items.setdefault(stored.relative_path, []).append(
            (index.fqn, stored.offset, stored.length, shape))
    return items


def _item_problem(data: memoryview, items: list[_Item], source: str) -> str | None:
    """What a load would refuse in this file's items: the first one, or None."""
    for fqn, offset, length, shape in items:
        try:
            tensor = decode_item(data[offset:offset + length], source, fqn)
        except CorruptShardError as exc:
            return str(exc)
        if tuple(tensor.shape) != shape:
            return f"{source} has shape {tuple(tensor.shape)} for {fqn!r}, expected {shape}"
    return None
