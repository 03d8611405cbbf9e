"""Manifest format, commit rule and retention decisions (pure, plus memory:// I/O)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest

from elastic_rt.checkpoint.checksum import checksum_of
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
    parse_step,
    read_manifest,
    scan,
    write_manifest,
)
from elastic_rt.checkpoint.storage import FsspecStorage
from elastic_rt.errors import CorruptShardError


def _dirs(*specs: tuple[int, str, bool]) -> list[DirState]:
    return [DirState(f"step-{step:08d}-{suffix}", has, 10) for step, suffix, has in specs]


def _names(dirs: list[DirState]) -> list[str]:
    return [d.name for d in dirs]


def _asking(dirs: list[DirState], asked: list[str]) -> Callable[[str], bool]:
    """``loadable`` over ``dirs`` (a manifest means loadable) that records what it was asked."""
    def loadable(name: str) -> bool:
        asked.append(name)
        return next(d.has_manifest for d in dirs if d.name == name)
    return loadable


def _all_settled(name: str) -> bool:
    return True


def test_new_name_carries_step_and_generation_and_parses_back() -> None:
    name = new_name(120, 7)
    assert name.startswith("step-00000120-g000007-")
    assert parse_step(name) == 120 and parse_name(name) == (120, 7)
    assert new_name(120, 7) != name
    assert parse_name("step-00000120-abcdef") == (120, 0)  # written before generations


def test_order_follows_generations_then_steps_then_names() -> None:
    abandoned, restored = "step-00000020-g000002-aaaaaa", "step-00000010-g000001-bbbbbb"
    newer = new_name(15, next_generation([abandoned, restored, "notes"], restored=1))
    assert parse_name(newer) == (15, 3)
    assert candidates([abandoned, restored, newer], None) == [newer, abandoned, restored]
    tie = ["step-00000005-g000004-cccccc", "step-00000005-g000004-bbbbbb"]
    assert candidates(tie, None) == candidates(list(reversed(tie)), None) == sorted(
        tie, reverse=True)


@pytest.mark.parametrize("name", ["step-1-abcdef", "other", "step-00000001-xyz123", ""])
def test_parse_step_ignores_folders_that_are_not_ours(name: str) -> None:
    assert parse_step(name) is None


def test_manifest_round_trips_through_json() -> None:
    manifest = Manifest(name="step-00000007-abcdef", step=7, layout={"dp": 2},
                        extra={"sampler": {"position": 3}}, objects={"lr": 0.1},
                        files=(FileEntry(".metadata", 10, "xxh3_64:00000000deadbeef"),),
                        world_size=2)
    again = Manifest.from_json(manifest.to_json(), "x")
    assert again == manifest
    assert again.nbytes == 10
    tampered = manifest.to_json().replace(b'"step": 7', b'"step": 8')
    with pytest.raises(CorruptShardError, match="does not match its checksum"):
        Manifest.from_json(tampered, "x")


@pytest.mark.parametrize("data", [b"not json", b"{}", b'{"format_version": 99}',
                                  b'{"format_version": 1, "files": [{"path": 1}]}'])
def test_a_bad_manifest_is_a_corrupt_checkpoint(data: bytes) -> None:
    with pytest.raises(CorruptShardError, match="not a valid checkpoint manifest"):
        Manifest.from_json(data, "memory://x/manifest.json")


def test_a_version_1_manifest_reads_with_its_crc32_checksums() -> None:
    data = json.dumps({"format_version": 1, "name": "step-00000001-abcdef", "step": 1,
                       "files": [{"path": "__0_0.distcp", "size": 3, "crc32": "352441c2"}]})
    manifest = Manifest.from_json(data.encode(), "x")
    (entry,) = manifest.files
    assert entry.checksum == "crc32:352441c2" == checksum_of(b"abc", like=entry.checksum)


def test_new_checksums_are_xxh3_and_tell_their_algorithm() -> None:
    assert checksum_of(b"abc") == "xxh3_64:78af5f94892f3950"
    assert checksum_of(b"abd") != checksum_of(b"abc")
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md4'"):
        checksum_of(b"abc", like="md4:00")


def test_without_a_pointer_every_manifest_commits_oldest_first() -> None:
    dirs = _dirs((3, "aaaaaa", True), (1, "bbbbbb", True), (2, "cccccc", False))
    assert committed_names(dirs, None) == ["step-00000001-bbbbbb", "step-00000003-aaaaaa"]


def test_with_a_pointer_manifests_newer_than_it_are_not_committed() -> None:
    dirs = _dirs((1, "aaaaaa", True), (2, "bbbbbb", True), (2, "cccccc", True),
                 (3, "dddddd", True))
    assert committed_names(dirs, "step-00000002-bbbbbb") == [
        "step-00000001-aaaaaa", "step-00000002-bbbbbb"]


def test_retention_keeps_the_newest_committed_and_drops_partials() -> None:
    dirs = _dirs((1, "aaaaaa", True), (2, "bbbbbb", True), (3, "cccccc", False),
                 (4, "dddddd", True), (5, "eeeeee", False))
    asked: list[str] = []
    doomed = names_to_remove(_names(dirs), None, keep=2, protected={"step-00000005-eeeeee"},
                             loadable=_asking(dirs, asked), settled=_all_settled)
    assert doomed == ["step-00000001-aaaaaa", "step-00000003-cccccc"]
    assert asked == ["step-00000005-eeeeee", "step-00000004-dddddd", "step-00000003-cccccc",
                     "step-00000002-bbbbbb"]  # newest first, and no further than needed


def test_retention_with_keep_zero_keeps_every_committed() -> None:
    dirs = _dirs((1, "aaaaaa", True), (2, "bbbbbb", False))
    assert names_to_remove(_names(dirs), None, keep=0, protected=set(),
                           loadable=_asking(dirs, []), settled=_all_settled) == [
        "step-00000002-bbbbbb"]


def test_retention_spares_unsettled_folders_and_counts_only_loadable_ones() -> None:
    dirs = _dirs((1, "aaaaaa", True), (2, "bbbbbb", True), (3, "cccccc", False),
                 (4, "dddddd", False))  # 4: a live writer's; 3: a damaged manifest
    doomed = names_to_remove(_names(dirs), None, keep=2, protected=set(),
                             loadable=_asking(dirs, []),
                             settled=lambda name: name != "step-00000004-dddddd")
    assert doomed == ["step-00000003-cccccc"]  # 1 and 2 are the two loadable ones


def test_retention_removes_a_fenced_out_manifest_newer_than_the_pointer() -> None:
    dirs = _dirs((1, "aaaaaa", True), (2, "bbbbbb", True))
    assert names_to_remove(_names(dirs) + ["notes"], "step-00000001-aaaaaa", keep=3,
                           protected=set(), loadable=_asking(dirs, []),
                           settled=_all_settled) == [
        "step-00000002-bbbbbb"]


def test_candidates_are_newest_first_and_no_newer_than_the_pointer() -> None:
    names = ["step-00000002-bbbbbb", "other", "step-00000001-aaaaaa", "step-00000003-cccccc"]
    assert candidates(names, None) == ["step-00000003-cccccc", "step-00000002-bbbbbb",
                                       "step-00000001-aaaaaa"]
    assert candidates(names, "step-00000002-bbbbbb") == ["step-00000002-bbbbbb",
                                                         "step-00000001-aaaaaa"]
    assert candidates(names, "garbage") == []


def test_scan_and_manifest_io_on_memory_storage() -> None:
    storage = FsspecStorage(f"memory://manifest-{uuid.uuid4().hex[:8]}")
    manifest = Manifest(name="step-00000002-abcdef", step=2, files=())
    storage.write_bytes("step-00000001-aaaaaa/__0_0.distcp", b"12345")
    write_manifest(storage, manifest)
    storage.write_bytes("not-a-checkpoint/x", b"")
    assert scan(storage) == [DirState("step-00000001-aaaaaa", False, 5),
                             DirState("step-00000002-abcdef", True,
                                      len(manifest.to_json()))]
    assert read_manifest(storage, "step-00000002-abcdef") == manifest
    with pytest.raises(CorruptShardError, match=f"{MANIFEST_FILE} is missing"):
        read_manifest(storage, "step-00000001-aaaaaa")
