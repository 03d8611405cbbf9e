"""Checkpointer behaviour in one process: commit, async, retention, fallback, errors."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint.commit import PARTIAL_GRACE_S
from elastic_rt.checkpoint.inspect import ls, verify
from elastic_rt.checkpoint.manifest import MANIFEST_FILE
from elastic_rt.checkpoint.storage import call_with_retries
from elastic_rt.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptShardError,
    FencedOutError,
    UnknownURLSchemeError,
)
from elastic_rt.events import EventSink, read_events
from tests.checkpoint_tamper import age, read_manifest_json, write_manifest_json


class FencedPointer:
    """In-memory PointerStore (unit tests only); refuses commits once fenced."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.is_fenced = False

    def read(self) -> str | None:
        return self.name

    def commit(self, name: str, *, step: int, token: int | None) -> None:
        if self.is_fenced:
            raise FencedOutError("round 3 is stale")
        self.name = name


def _state(value: float) -> dict:
    return {"w": torch.full((4, 3), value), "opt": {"lr": value, "betas": (0.9, 0.99)},
            "step": int(value)}


def _empty() -> dict:
    return {"w": torch.zeros(4, 3), "opt": {"lr": 0.0, "betas": (0.0, 0.0)}, "step": 0}


@pytest.fixture()
def url(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


def test_async_save_copies_state_so_later_changes_do_not_leak_in(url: str) -> None:
    ckpt = Checkpointer(url)
    state = _state(1.0)
    ckpt.save(1, state, layout={"dp": 1}, extra={"sampler": 7})
    state["w"].fill_(99.0)  # the next training step, while the write may still run
    info = ckpt.wait()
    assert info is not None and info.committed and info.extra == {"sampler": 7}
    target = _empty()
    loaded = ckpt.load(target)
    assert loaded.name == info.name and loaded.layout == {"dp": 1}
    assert torch.all(target["w"] == 1.0)
    assert target["opt"] == {"lr": 1.0, "betas": (0.9, 0.99)} and target["step"] == 1
    ckpt.close()


def test_every_save_goes_to_a_fresh_folder_and_retention_keeps_k(url: str) -> None:
    ckpt = Checkpointer(url, keep=2, async_save=False)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step))
    infos = ckpt.list()
    assert [i.step for i in infos] == [2, 3] and all(i.committed for i in infos)
    assert len({i.name for i in infos}) == 2


def test_a_partial_folder_is_invisible_and_removed_by_the_next_save(url: str) -> None:
    ckpt = Checkpointer(url, async_save=False)
    ckpt.save(1, _state(1))
    partial = Path(url) / "step-00000002-g000002-abcdef"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert [i.committed for i in ckpt.list()] == [True, False]
    target = _empty()
    assert ckpt.load(target).step == 1
    ckpt.save(3, _state(3))
    assert partial.exists()  # it may still be a live writer's
    age(partial, PARTIAL_GRACE_S + 60)
    ckpt.save(4, _state(4))
    assert not partial.exists()


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(url: str, tmp_path: Path) -> None:
    events = EventSink(str(tmp_path / "events.jsonl"), source="worker")
    ckpt = Checkpointer(url, async_save=False, events=events)
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))
    newest = max(Path(url).iterdir())
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-10])
    target = _empty()
    assert ckpt.load(target).step == 1
    assert torch.all(target["w"] == 1.0)
    restored = [e for e in read_events(events.path or "") if e.name == "checkpoint.restored"]
    assert restored[-1].metadata["fallback_from"] == [newest.name]
    with pytest.raises(CorruptShardError, match=f"{newest.name}/{data.name}"):
        ckpt.load(_empty(), name=newest.name)


def test_a_missing_file_is_named(url: str) -> None:
    ckpt = Checkpointer(url, async_save=False)
    ckpt.save(1, _state(1))
    folder = next(Path(url).iterdir())
    next(folder.glob("*.distcp")).unlink()
    with pytest.raises(CorruptShardError, match="__0_0.distcp is missing"):
        ckpt.load(_empty())


def test_loading_into_another_model_is_a_mismatch(url: str) -> None:
    ckpt = Checkpointer(url, async_save=False)
    ckpt.save(1, _state(1))
    with pytest.raises(CheckpointMismatchError, match=r"'w' with shape \(4, 3\)"):
        ckpt.load({"w": torch.zeros(5, 3)})
    with pytest.raises(CheckpointMismatchError, match="no tensor 'other'"):
        ckpt.load({"other": torch.zeros(1)})
    with pytest.raises(CheckpointMismatchError, match="no value for 'epoch'"):
        ckpt.load({"w": torch.zeros(4, 3), "epoch": 1})


def test_no_checkpoint_yet_is_not_found(url: str) -> None:
    with pytest.raises(CheckpointNotFoundError):
        Checkpointer(url).load(_empty())


def test_a_fenced_out_save_fails_and_stays_invisible(url: str) -> None:
    pointer = FencedPointer()
    ckpt = Checkpointer(url, pointer=pointer)
    ckpt.save(1, _state(1))
    first = ckpt.wait()
    pointer.is_fenced = True
    ckpt.save(2, _state(2))
    with pytest.raises(FencedOutError):
        ckpt.wait()
    assert [i.committed for i in ckpt.list()] == [True, False]
    assert first is not None and ckpt.load(_empty()).name == first.name


def test_bad_arguments_are_one_line_user_errors(url: str) -> None:
    with pytest.raises(UnknownURLSchemeError, match="unknown scheme 'ftp'"):
        Checkpointer("ftp://host/x")
    with pytest.raises(ConfigError, match="keep=-1"):
        Checkpointer(url, keep=-1)
    ckpt = Checkpointer(url)
    with pytest.raises(ConfigError, match="extra= is not JSON-able"):
        ckpt.save(1, _state(1), extra={"x": object()})
    with pytest.raises(ConfigError, match="cannot be stored without pickle"):
        ckpt.save(1, {"w": torch.zeros(1), "thing": object()})


def test_should_save_follows_every_steps(url: str) -> None:
    ckpt = Checkpointer(url, every_steps=5)
    assert [s for s in range(12) if ckpt.should_save(s)] == [5, 10]
    assert not Checkpointer(url).should_save(5)


def test_ls_and_verify_report_each_checkpoint(url: str) -> None:
    ckpt = Checkpointer(f"memory://ls-{uuid.uuid4().hex[:8]}", async_save=False)
    ckpt.save(4, _state(4), layout={"dp": 2, "pp": 1, "tp": 1})
    (line,) = ls(ckpt.url)
    assert "step=4" in line and "layout=dp2xpp1xtp1" in line and line.endswith("committed")
    assert verify(ckpt.url)[0]
    name = ckpt.list()[0].name
    ckpt._storage.write_bytes(f"{name}/.metadata", b"garbage")
    ok, lines = verify(ckpt.url)
    assert not ok and ".metadata" in lines[1]
    assert MANIFEST_FILE not in "".join(lines)


def test_transient_storage_errors_are_retried() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert call_with_retries(flaky, url="s3://b/x") == "ok" and len(calls) == 3


def test_a_persistent_storage_error_becomes_a_checkpoint_error() -> None:
    def broken() -> None:
        raise ValueError("bad")

    with pytest.raises(CheckpointError, match="storage at s3://b/x failed: ValueError"):
        call_with_retries(broken, url="s3://b/x")


def test_a_synchronous_save_is_committed_when_save_returns(url: str) -> None:
    ckpt = Checkpointer(url, async_save=False)
    ckpt.save(1, _state(1))
    assert [i.committed for i in ckpt.list()] == [True]
    info = ckpt.wait()
    assert info is not None and info.step == 1
    assert ckpt.wait() is None


def test_a_checkpoint_written_before_generations_loads_and_sorts_below_new_ones(
        url: str) -> None:
    ckpt = Checkpointer(url, async_save=False, keep=0)
    ckpt.save(50, _state(50))
    (folder,) = Path(url).iterdir()
    legacy = folder.rename(Path(url) / "step-00000050-abcdef")  # a format 2 checkpoint
    body = read_manifest_json(legacy)
    del body["generation"], body["manifest_checksum"]
    body.update(format_version=2, name=legacy.name)
    write_manifest_json(legacy, body, reseal=False)
    target = _empty()
    assert ckpt.load(target).name == legacy.name and torch.all(target["w"] == 50.0)
    ckpt.save(3, _state(3))  # resumed from it: a lower step, a later commit
    assert ckpt.load(_empty()).step == 3
    assert verify(url)[0]
