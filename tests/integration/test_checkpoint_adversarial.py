"""Damaged and hostile checkpoints, on local disk and on S3 (moto), tried as an attacker
with write access to the storage and as a user with typos.

Each storage holds two checkpoints: step 1 (every value 1) and step 2 (every value 2).
An attack damages step 2; then the load must fall back to step 1 with nothing of
step 2 (or of anything outside its folder) in the state, no planted code may have run,
the damage is named in one line, ``verify`` exits 1 and ``ls`` exits 0 -- through the
CLI, without a traceback. One moto server serves the whole module.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from elastic_rt import cli
from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint.checksum import checksum_of
from elastic_rt.checkpoint.manifest import MANIFEST_FILE, parse_name, sealed_json
from elastic_rt.checkpoint.safe_pickle import load_metadata
from elastic_rt.checkpoint.storage import FsspecStorage
from elastic_rt.errors import (
    CheckpointError,
    CheckpointLocationError,
    CheckpointNotFoundError,
    CorruptShardError,
    StorageUnreachableError,
)
from tests.checkpoint_tamper import age
from tests.fixtures.s3 import S3_BUCKET

METADATA = ".metadata"


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4, 3), value), "b": torch.full((5,), value),
            "opt": {"lr": value, "betas": (0.9, value)}, "step": int(value)}


class _Payload:
    """Unpickling this makes ``path``: proof that code from storage ran."""

    def __init__(self, path: Path, call: Callable[..., Any] = os.mkdir) -> None:
        self.path, self.call = str(path), call

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.call, (self.path,))


@dataclass
class Site:
    """One checkpoint URL and raw access to its files, as an attacker has it."""

    url: str
    options: dict[str, Any]
    marker: Path
    """Where planted code would leave a trace."""
    names: list[str] = field(default_factory=list)

    @property
    def storage(self) -> FsspecStorage:
        return FsspecStorage(self.url, self.options)

    @property
    def good(self) -> str:
        return self.names[0]

    @property
    def bad(self) -> str:
        return self.names[1]

    def cli_options(self) -> list[str]:
        return [f"--storage-option={k}={v}" for k, v in self.options.items()]

    def checkpointer(self, **kwargs: Any) -> Checkpointer:
        return Checkpointer(self.url, storage_options=self.options, async_save=False, **kwargs)

    def read(self, rel: str) -> bytes:
        storage = self.storage
        return bytes(storage.fs.cat_file(storage.path(rel)))

    def write(self, rel: str, data: bytes) -> None:
        storage = self.storage
        if storage.is_local:
            os.makedirs(os.path.dirname(storage.path(rel)), exist_ok=True)
        storage.fs.pipe_file(storage.path(rel), data)

    def delete(self, rel: str) -> None:
        storage = self.storage
        storage.fs.rm(storage.path(rel))

    def make_folder(self, rel: str) -> None:
        """Put a folder where the file ``rel`` was."""
        self.delete(rel)
        if self.storage.is_local:
            os.mkdir(self.storage.path(rel))
        else:
            self.write(f"{rel}/inside", b"x")

    def shard(self, name: str) -> str:
        return next(f["path"] for f in self.manifest(name)["files"]
                    if f["path"].endswith(".distcp"))

    def manifest(self, name: str) -> dict[str, Any]:
        return json.loads(self.read(f"{name}/{MANIFEST_FILE}"))

    def put_manifest(self, name: str, body: dict[str, Any], reseal: bool = True) -> None:
        data = sealed_json(body) if reseal else json.dumps(body).encode()
        self.write(f"{name}/{MANIFEST_FILE}", data)

    def plant(self, name: str, filename: str, data: bytes) -> None:
        """Replace a file and fix up the manifest's entry and checksum."""
        self.write(f"{name}/{filename}", data)
        body = self.manifest(name)
        for entry in body["files"]:
            if entry["path"] == filename:
                entry["size"], entry["checksum"] = len(data), checksum_of(data)
        self.put_manifest(name, body)

    def metadata(self, name: str) -> Any:
        return load_metadata(self.read(f"{name}/{METADATA}"), "test")


# -- storages ------------------------------------------------------------------------

def _copy_tree(source: Site, url: str, marker: Path) -> Site:
    site = Site(url, source.options, marker, list(source.names))
    src, dst = source.storage, site.storage
    if src.is_local:
        shutil.copytree(src.root, dst.root)
    else:
        for path in src.fs.find(src.root):
            dst.fs.pipe_file(dst.path(path[len(src.root) + 1:]), src.fs.cat_file(path))
    return site


def _template(backend: str, options: dict[str, Any], root: Path) -> Site:
    """Two checkpoints (step 1 and step 2) to copy for each test."""
    if backend == "local":
        root.mkdir()
        site = Site(str(root), {}, root / "unused")
    else:
        site = Site(f"s3://{S3_BUCKET}/template-{uuid.uuid4().hex[:8]}", dict(options),
                    Path("unused"))
    ckpt = site.checkpointer(keep=0)
    for step in (1, 2):
        ckpt.save(step, _state(float(step)), layout={"dp": 1})
    site.names = [i.name for i in ckpt.list()]
    assert [parse_name(n) for n in site.names] == [(1, 1), (2, 2)]
    return site


@pytest.fixture(scope="module")
def templates() -> dict[str, Site]:
    """One template per storage, made by the first test that needs it."""
    return {}


@pytest.fixture()
def site(request: pytest.FixtureRequest, templates: dict[str, Site],
         tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Site:
    """A fresh copy of the template of ``request.param`` ("local" or "s3")."""
    backend = request.param
    options = request.getfixturevalue("s3_server") if backend == "s3" else {}
    if backend not in templates:
        templates[backend] = _template(backend, options, tmp_path_factory.mktemp("t") / "ckpt")
    if backend == "local":
        url = str(tmp_path / "ckpt")
    else:
        url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"
    return _copy_tree(templates[backend], url, tmp_path / "pwned")


BACKENDS = ["local", "s3"]


# -- attacks on step 2 -----------------------------------------------------------------

Attack = Callable[[Site], None]


def _manifest_edit(edit: Callable[[dict[str, Any]], Any], reseal: bool = True) -> Attack:
    def attack(site: Site) -> None:
        body = site.manifest(site.bad)
        edit(body)
        site.put_manifest(site.bad, body, reseal)
    return attack


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        body[key] = value
    return edit


def _file_field(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        entry = next(f for f in body["files"] if f["path"].endswith(".distcp"))
        entry[key] = value
    return edit


def _object(value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda body: body["objects"].__setitem__("opt.lr", value)


def _raw_manifest(data: bytes) -> Attack:
    return lambda site: site.write(f"{site.bad}/{MANIFEST_FILE}", data)


def _manifest_bytes(change: Callable[[bytes], bytes]) -> Attack:
    def attack(site: Site) -> None:
        rel = f"{site.bad}/{MANIFEST_FILE}"
        site.write(rel, change(site.read(rel)))
    return attack


def _downgrade(version: int) -> Attack:
    def edit(body: dict[str, Any]) -> None:
        del body["generation"], body["manifest_checksum"]
        body["format_version"], body["step"] = version, 2
        if version == 1:
            for entry in body["files"]:
                entry["crc32"] = entry.pop("checksum")
    return _manifest_edit(edit, reseal=False)


def _metadata_edit(edit: Callable[[Any], Any]) -> Attack:
    def attack(site: Site) -> None:
        metadata = site.metadata(site.bad)
        edit(metadata)
        site.plant(site.bad, METADATA, pickle.dumps(metadata))
    return attack


def _storage_info(field_name: str, value: Any) -> Callable[[Any], None]:
    def edit(metadata: Any) -> None:
        info = next(iter(metadata.storage_data.values()))
        setattr(info, field_name, value)
    return edit


def _file_bytes(which: str, change: Callable[[bytes], bytes]) -> Attack:
    def attack(site: Site) -> None:
        name = METADATA if which == "metadata" else site.shard(site.bad)
        rel = f"{site.bad}/{name}"
        site.write(rel, change(site.read(rel)))
    return attack


def _flip(at: float) -> Callable[[bytes], bytes]:
    def change(data: bytes) -> bytes:
        raw = bytearray(data)
        raw[min(int(len(raw) * at), len(raw) - 1)] ^= 0xFF
        return bytes(raw)
    return change


def _missing(which: str) -> Attack:
    def attack(site: Site) -> None:
        name = {"metadata": METADATA, "manifest": MANIFEST_FILE}.get(which) or site.shard(site.bad)
        site.delete(f"{site.bad}/{name}")
    return attack


def _folder_instead(which: str) -> Attack:
    def attack(site: Site) -> None:
        name = {"metadata": METADATA, "manifest": MANIFEST_FILE}.get(which) or site.shard(site.bad)
        site.make_folder(f"{site.bad}/{name}")
    return attack


def _outside_secret(site: Site) -> tuple[str, str]:
    """A valid checkpoint of value 666 beside the run's URL: (relative path of its
    shard from inside step 2's folder, its folder name)."""
    outside = Site(f"{site.url}-outside", site.options, site.marker)
    outside.checkpointer().save(2, _state(666.0))
    (secret,) = [i.name for i in outside.checkpointer().list()]
    prefix = site.url.rstrip("/").rsplit("/", 1)[1]
    return f"../../{prefix}-outside/{secret}/{outside.shard(secret)}", secret


def _traverse_both(site: Site) -> None:
    """Manifest and metadata both point at the outside file, with matching checksums."""
    rel, secret = _outside_secret(site)
    outside = Site(f"{site.url}-outside", site.options, site.marker)
    data = outside.read(f"{secret}/{outside.shard(secret)}")
    metadata = outside.metadata(secret)
    for info in metadata.storage_data.values():
        info.relative_path = rel
    meta_bytes = pickle.dumps(metadata)
    site.write(f"{site.bad}/{METADATA}", meta_bytes)
    body = site.manifest(site.bad)
    body["files"] = [{"path": rel, "size": len(data), "checksum": checksum_of(data)},
                     {"path": METADATA, "size": len(meta_bytes),
                      "checksum": checksum_of(meta_bytes)}]
    site.put_manifest(site.bad, body)


def _traverse_metadata(site: Site) -> None:
    rel, _ = _outside_secret(site)
    _metadata_edit(_storage_info("relative_path", rel))(site)


def _planted_item(site: Site) -> None:
    """A torch.save of a payload put in front of the shard, the first item pointing at it."""
    import io

    buffer = io.BytesIO()
    torch.save({"x": _Payload(site.marker)}, buffer)
    payload = buffer.getvalue()
    shard = site.shard(site.bad)
    metadata = site.metadata(site.bad)
    for n, info in enumerate(metadata.storage_data.values()):
        info.offset, info.length = ((0, len(payload)) if n == 0
                                    else (info.offset + len(payload), info.length))
    site.plant(site.bad, shard, payload + site.read(f"{site.bad}/{shard}"))
    site.plant(site.bad, METADATA, pickle.dumps(metadata))


def _overlap(metadata: Any) -> None:
    first, second = list(metadata.storage_data.values())[:2]
    second.offset, second.length = first.offset, first.length


def _bytes_entry(metadata: Any) -> None:
    metadata.state_dict_metadata["w"] = BytesStorageMetadata()


def _unknown_fqn(metadata: Any) -> None:
    info = next(iter(metadata.storage_data.values()))
    metadata.storage_data[MetadataIndex("ghost", [0])] = copy.copy(info)


def _drop_storage(metadata: Any) -> None:
    del metadata.storage_data[next(iter(metadata.storage_data))]


def _chunk_too_big(metadata: Any) -> None:
    chunk = metadata.state_dict_metadata["w"].chunks[0]
    chunk.sizes = torch.Size([99, 3])


def _dtype_text(metadata: Any) -> None:
    metadata.state_dict_metadata["w"].properties.dtype = "float32"


def _plant_metadata(payload: Callable[[Site], Any]) -> Attack:
    return lambda site: site.plant(site.bad, METADATA, pickle.dumps(payload(site)))


_MISTYPED: list[tuple[str, list[Any]]] = [
    ("step", ["2", True, -1, 2.0, None]), ("generation", [2.5, "2", -2]),
    ("world_size", [0, "1"]), ("created_ms", ["now"]), ("files", [{}, "x"]),
    ("extra", [[], "x"]), ("objects", [[]]), ("layout", [["dp", 1], {"dp": "1"}, {"dp": 0}]),
    ("torch_version", [3]), ("format_version", [99, "3", None]),
]

CASES: dict[str, tuple[Attack, str]] = {
    # the manifest's own checksum catches any edit made without recomputing it
    **{f"edit-{key}": (_manifest_edit(_set(key, value), reseal=False), "does not match")
       for key, value in [("step", 3), ("generation", 5), ("extra", {"sampler": 9}),
                          ("layout", {"dp": 4}), ("world_size", 8), ("torch_version", "0.1"),
                          ("created_ms", 1), ("name", "step-00000002-g000002-000000")]},
    "edit-objects-lr": (_manifest_edit(_object(0.5), reseal=False), "does not match"),
    "edit-file-size": (_manifest_edit(_file_field("size", 1), reseal=False), "does not match"),
    "edit-file-checksum": (_manifest_edit(_file_field("checksum", "xxh3_64:" + "0" * 16),
                                          reseal=False), "does not match"),
    "edit-own-checksum": (_manifest_edit(_set("manifest_checksum", "xxh3_64:" + "1" * 16),
                                         reseal=False), "does not match"),
    "no-own-checksum": (_manifest_edit(lambda b: b.pop("manifest_checksum"), reseal=False),
                        "manifest_checksum is missing"),
    "downgrade-format-2": (_downgrade(2), "disagree with the name"),
    "downgrade-format-1": (_downgrade(1), "disagree with the name"),
    # mistyped, unknown or inconsistent fields, resealed by the attacker
    **{f"mistyped-{key}-{i}": (_manifest_edit(_set(key, value)), key)
       for key, values in _MISTYPED for i, value in enumerate(values)},
    "inconsistent-generation": (_manifest_edit(_set("generation", 9)), "disagree"),
    "inconsistent-step": (_manifest_edit(_set("step", 7)), "disagree"),
    "other-folder-name": (_manifest_edit(_set("name", "step-00000002-g000002-000000")),
                          "names another checkpoint"),
    "name-not-ours": (_manifest_edit(_set("name", "../x")), "not a checkpoint folder name"),
    "unknown-field": (_manifest_edit(_set("hook", "os.system")), "unknown fields"),
    "missing-files": (_manifest_edit(lambda b: b.pop("files")), "missing fields"),
    **{f"file-{key}-{i}": (_manifest_edit(_file_field(key, value)), msg)
       for key, values, msg in [("size", ["12", -5, 1.5, None], "has the size"),
                                ("checksum", ["md5:" + "0" * 32, 12345, "xxh3_64:XYZ", "",
                                              "sha256:00"], "has the checksum")]
       for i, value in enumerate(values)},
    "file-entry-extra-key": (_manifest_edit(_file_field("offset", 0)), "not exactly"),
    "file-entry-no-checksum": (_manifest_edit(lambda b: b["files"][0].pop("checksum")),
                               "not exactly"),
    "file-listed-twice": (_manifest_edit(lambda b: b["files"].append(b["files"][0])),
                          "listed twice"),
    "file-size-lies": (_manifest_edit(_file_field("size", 10 ** 6)), "fails its check"),
    **{f"object-{i}": (_manifest_edit(_object(value)), "opt.lr")
       for i, value in enumerate([{"t": "list", "v": 5}, {"t": "pickle", "v": "gASV"},
                                  {"t": "dtype", "v": "os"}, {"t": "dtype", "v": "__class__"},
                                  {"t": "dict", "v": [[{"t": "list", "v": []}, 1]]},
                                  {"t": "dict", "v": [[1]]}, [1, 2], {"v": 1}])},
    # not a manifest at all
    "manifest-array": (_raw_manifest(b"[]"), "not an object"),
    "manifest-garbage": (_raw_manifest(b"\x00\xffgarbage"), "not a valid checkpoint manifest"),
    "manifest-repeated-key": (_manifest_bytes(lambda d: d.replace(b'"step": 2,',
                                                                  b'"step": 2, "step": 2,')),
                              "repeated key"),
    "manifest-deep": (_raw_manifest(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                      "not a valid checkpoint manifest"),
    "manifest-truncated": (_manifest_bytes(lambda d: d[: len(d) // 2]), "not a valid"),
    "manifest-flipped": (_manifest_bytes(lambda d: d.replace(b'"step": 2', b'"step": 3')),
                         "does not match"),
    "manifest-grown": (_manifest_bytes(lambda d: d + b"x"), "not a valid"),
    # reads outside the folder
    "traverse-manifest-and-metadata": (_traverse_both, "not a plain name"),
    "traverse-metadata-only": (_traverse_metadata, "does not list"),
    **{f"path-{i}": (_manifest_edit(_file_field("path", value)), "not a plain name")
       for i, value in enumerate(["/etc/passwd", "sub/__0_0.distcp", "..", ".", "", ".hidden",
                                  "a\\..\\b", 7])},
    "metadata-path-index": (_metadata_edit(_storage_info("relative_path", METADATA)),
                            "the index itself"),
    "metadata-path-manifest": (_metadata_edit(_storage_info("relative_path", MANIFEST_FILE)),
                               "does not list"),
    "metadata-offset-beyond": (_metadata_edit(_storage_info("offset", 10 ** 9)), "lies outside"),
    "metadata-length-negative": (_metadata_edit(_storage_info("length", -1)), "lies outside"),
    "metadata-offset-text": (_metadata_edit(_storage_info("offset", "0")), "lies outside"),
    "metadata-transform": (_metadata_edit(_storage_info("transform_descriptors", ["gz"])),
                           "not a plain byte range"),
    "metadata-overlap": (_metadata_edit(_overlap), "overlap"),
    "metadata-chunk-unstored": (_metadata_edit(_drop_storage), "stored nowhere"),
    "metadata-unknown-fqn": (_metadata_edit(_unknown_fqn), "which is no tensor"),
    "metadata-chunk-too-big": (_metadata_edit(_chunk_too_big), "outside its size"),
    "metadata-dtype-text": (_metadata_edit(_dtype_text), "no valid dtype"),
    "metadata-index-list": (_metadata_edit(lambda m: setattr(m, "storage_data", [])),
                            "not a mapping"),
    # planted pickles
    "pickle-object-entry": (_metadata_edit(_bytes_entry), "not a tensor"),
    "pickle-metadata-mkdir": (_plant_metadata(lambda s: _Payload(s.marker)), "refused"),
    "pickle-metadata-exec": (_plant_metadata(lambda s: _Payload(s.marker, exec)), "refused"),
    "pickle-metadata-dict": (_plant_metadata(lambda s: {"a": _Payload(s.marker)}), "refused"),
    "pickle-metadata-not-metadata": (_plant_metadata(lambda s: {"a": 1}), "holds a dict"),
    "pickle-in-tensor-item": (_planted_item, "refused"),
    # bytes flipped, cut and grown
    **{f"shard-flip-{at}": (_file_bytes("shard", _flip(at)), "fails its check")
       for at in (0.0, 0.5, 1.0)},
    "shard-truncated": (_file_bytes("shard", lambda d: d[:-1]), "fails its check"),
    "shard-emptied": (_file_bytes("shard", lambda d: b""), "fails its check"),
    "shard-grown": (_file_bytes("shard", lambda d: d + b"\0"), "fails its check"),
    "shard-grown-a-lot": (_file_bytes("shard", lambda d: d + bytes(1 << 20)), "fails its check"),
    "metadata-flip": (_file_bytes("metadata", _flip(0.5)), "fails its check"),
    "metadata-truncated": (_file_bytes("metadata", lambda d: d[:-1]), "fails its check"),
    "metadata-grown": (_file_bytes("metadata", lambda d: d + b"\0"), "fails its check"),
    # missing files, folders in their place
    "shard-missing": (_missing("shard"), "missing"),
    "metadata-missing": (_missing("metadata"), "missing"),
    "shard-is-a-folder": (_folder_instead("shard"), "missing or not a file"),
    "metadata-is-a-folder": (_folder_instead("metadata"), "missing or not a file"),
}


S3_CASES = [
    "edit-step", "mistyped-step-0", "file-size-lies", "manifest-garbage",
    "traverse-manifest-and-metadata", "traverse-metadata-only", "metadata-overlap",
    "pickle-metadata-mkdir", "pickle-in-tensor-item", "shard-flip-0.5", "shard-truncated",
    "shard-emptied", "shard-grown", "metadata-truncated", "shard-missing", "shard-is-a-folder",
    "metadata-is-a-folder",
]
"""Every kind of attack once on S3, where sizes, listings and "folders" differ from a
disk; all of them on the disk (a case on moto costs ~1.5 s of requests)."""


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["checkpoint", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_fell_back(site: Site) -> None:
    """The load took step 1, every value is 1, and no planted code ran."""
    target = _state(0.0)
    info = site.checkpointer().load(target)
    assert info.name == site.good
    assert all(torch.all(t == 1.0) for t in (target["w"], target["b"]))
    assert target["opt"] == {"lr": 1.0, "betas": (0.9, 1.0)} and target["step"] == 1
    assert not site.marker.exists(), "code from storage ran"


@pytest.mark.parametrize("site, case", [("local", c) for c in sorted(CASES)]
                         + [("s3", c) for c in S3_CASES], indirect=["site"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_loads(
        site: Site, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    attack, message = CASES[case]
    attack(site)
    with pytest.raises(CorruptShardError) as caught:
        site.checkpointer().load(_state(0.0), name=site.bad)
    text = str(caught.value)
    assert "\n" not in text and site.bad in text and message in text, text
    _assert_fell_back(site)

    code, out, err = _run_cli(capsys, "verify", site.url, *site.cli_options())
    assert code == 1 and "Traceback" not in out + err
    assert f"{site.bad}  CORRUPT" in out and f"{site.good}  ok" in out, out
    code, out, err = _run_cli(capsys, "ls", site.url, *site.cli_options())
    assert code == 0 and "Traceback" not in out + err and len(out.splitlines()) == 2, out + err


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", ["manifest-missing", "manifest-is-a-folder"])
def test_without_its_manifest_a_checkpoint_was_never_committed(
        site: Site, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    (_missing if case == "manifest-missing" else _folder_instead)("manifest")(site)
    _assert_fell_back(site)
    code, out, _ = _run_cli(capsys, "verify", site.url, *site.cli_options())
    assert code == 0 and site.bad not in out and f"{site.good}  ok" in out
    code, out, _ = _run_cli(capsys, "ls", site.url, *site.cli_options())
    assert code == 0 and f"{site.bad}" in out and "partial" in out


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
def test_an_untouched_copy_verifies(
        site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run_cli(capsys, "verify", site.url, *site.cli_options())
    assert code == 0 and out.count("  ok  ") == 2


# -- commit order ------------------------------------------------------------------------

@pytest.mark.parametrize("site", BACKENDS, indirect=True)
def test_an_abandoned_future_never_comes_back(site: Site) -> None:
    """Restore step 1 while step 2 exists and save step 2 again: the new commit wins
    over the abandoned step 2 for every reader, every time (by name it was a coin flip)."""
    ckpt = site.checkpointer(keep=0)
    ckpt.load(_state(0.0), name=site.good)
    ckpt.save(2, _state(5.0))  # the same step as the abandoned one
    (resaved,) = [n for n in (i.name for i in ckpt.list()) if n not in site.names]
    for _ in range(3):  # every reader, every time
        target = _state(0.0)
        assert site.checkpointer().load(target).name == resaved
        assert torch.all(target["w"] == 5.0)


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
def test_a_later_commit_wins_over_a_higher_step_from_the_same_restore(site: Site) -> None:
    first, second = site.checkpointer(keep=0), site.checkpointer(keep=0)
    for ckpt in (first, second):
        ckpt.load(_state(0.0), name=site.good)
    first.save(9, _state(9.0))
    second.save(3, _state(3.0))  # committed after step 9: the run went on from here
    target = _state(0.0)
    assert site.checkpointer().load(target).step == 3 and torch.all(target["w"] == 3.0)


# -- retention -----------------------------------------------------------------------------

def _live_partial(site: Site, name: str) -> None:
    site.write(f"{name}/__0_0.distcp", b"being written")


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
def test_retention_never_deletes_a_folder_a_live_writer_is_filling(site: Site) -> None:
    older, newer = "step-00000001-g000001-aaaaaa", "step-00000009-g000099-bbbbbb"
    for name in (older, newer):
        _live_partial(site, name)
    site.checkpointer(keep=1).save(3, _state(3.0))
    dirs = site.storage.list_dirs()
    assert older in dirs and newer in dirs
    assert site.good not in dirs  # committed and beyond keep=1


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
def test_retention_keeps_k_loadable_checkpoints_past_a_damaged_newest(site: Site) -> None:
    _manifest_edit(_set("step", 3), reseal=False)(site)  # damage step 2's manifest
    ckpt = site.checkpointer(keep=2)
    ckpt.save(3, _state(3.0))
    dirs = site.storage.list_dirs()
    assert site.bad not in dirs and site.good in dirs and len(dirs) == 2
    assert all(i.committed for i in ckpt.list())


def test_a_stale_partial_is_cleaned_up(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    site = Site(str(root), {}, tmp_path / "pwned")
    stale = "step-00000001-g000001-aaaaaa"
    _live_partial(site, stale)
    from elastic_rt.checkpoint.commit import PARTIAL_GRACE_S
    age(root / stale, PARTIAL_GRACE_S + 60)
    site.checkpointer(keep=1).save(2, _state(2.0))
    assert stale not in site.storage.list_dirs()


def test_a_save_whose_folder_vanished_fails_and_commits_nothing(tmp_path: Path) -> None:
    """Another process removes the folder while it is written: the save fails."""
    root = tmp_path / "ckpt"
    root.mkdir()
    ckpt = Checkpointer(str(root), async_save=True, keep=0)
    state = {f"w{i}": torch.ones(1 << 20) for i in range(16)}  # 64 MiB: a write to race
    removed = threading.Event()
    done = threading.Event()

    def remove_when_it_appears() -> None:
        # Once a file of the save is in its folder: mid-write. (A folder removed before its
        # first file is made again by the writer, and that save is whole; removing it then
        # made this test pass or fail by timing.)
        while not removed.is_set() and not done.wait(0.001):  # until the save ends
            for folder in root.iterdir():
                if folder.is_dir() and any(folder.iterdir()):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.set()

    remover = threading.Thread(target=remove_when_it_appears, daemon=True)
    remover.start()
    ckpt.save(1, state)
    try:
        with pytest.raises(CheckpointError):
            ckpt.wait()
    finally:
        done.set()
        remover.join(timeout=10)
    assert removed.is_set()
    assert not [i for i in ckpt.list() if i.committed]
    ckpt.close()


# -- missing locations -----------------------------------------------------------------------

def _one_line_exit_2(capsys: pytest.CaptureFixture[str], args: list[str],
                     wanted: str) -> None:
    for action in ("ls", "verify"):
        code, out, err = _run_cli(capsys, action, *args)
        assert code == 2 and out == "" and wanted in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_missing_local_folder_is_an_error_not_a_fresh_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    typo = tmp_path / "no-such-root" / "run"
    with pytest.raises(CheckpointLocationError, match="does not exist"):
        Checkpointer(str(typo)).load(_state(0.0))
    _one_line_exit_2(capsys, [str(typo)], "does not exist")
    _one_line_exit_2(capsys, [str(tmp_path / "new-run")], "does not exist")
    (tmp_path / "a-file").write_text("x")
    _one_line_exit_2(capsys, [str(tmp_path / "a-file")], "is a file")
    # a new run folder under an existing root starts fresh; so does an existing empty one
    with pytest.raises(CheckpointNotFoundError):
        Checkpointer(str(tmp_path / "new-run")).load(_state(0.0))
    (tmp_path / "new-run").mkdir()
    code, out, _ = _run_cli(capsys, "verify", str(tmp_path / "new-run"))
    assert code == 0 and "no committed checkpoint" in out


def test_a_missing_bucket_is_an_error_not_a_fresh_start(
        s3_server: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/run"
    with pytest.raises(CheckpointLocationError, match="bucket .* does not exist"):
        Checkpointer(url, storage_options=s3_server).load(_state(0.0))
    _one_line_exit_2(capsys, [url, f"--storage-option=endpoint_url={s3_server['endpoint_url']}"],
                     "does not exist")
    empty = f"s3://{S3_BUCKET}/empty-{uuid.uuid4().hex[:6]}"
    with pytest.raises(CheckpointNotFoundError):
        Checkpointer(empty, storage_options=s3_server).load(_state(0.0))


def test_an_unreachable_endpoint_is_a_clear_error_at_start(
        s3_server: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_rt.etcd_server import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StorageUnreachableError, match="cannot be reached"):
        Checkpointer(f"s3://{S3_BUCKET}/x", storage_options={"endpoint_url": endpoint}).load(
            _state(0.0))
    _one_line_exit_2(capsys, [f"s3://{S3_BUCKET}/x", f"--storage-option=endpoint_url={endpoint}"],
                     "cannot be reached")


def test_a_bad_storage_option_is_one_line(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    _one_line_exit_2(capsys, [str(tmp_path), "--storage-option", "endpoint_url"],
                     "is not KEY=VALUE")


@pytest.mark.parametrize("site", ["s3"], indirect=True)
def test_the_cli_on_s3_prints_no_driver_chatter(site: Site) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_rt.cli", "checkpoint", "ls", site.url,
         *site.cli_options()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert len(proc.stdout.splitlines()) == 2 and "committed" in proc.stdout
