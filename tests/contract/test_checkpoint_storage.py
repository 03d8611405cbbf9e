"""One storage contract, run against file://, memory:// and s3:// (moto over HTTP)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint.inspect import verify
from elastic_rt.checkpoint.storage import FsspecStorage
from elastic_rt.errors import CorruptShardError, CredentialsError

BACKENDS = ["file", "memory", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """(root URL, storage_options) of an empty location on each backend."""
    if request.param == "file":
        return f"file://{tmp_path}/root", {}
    if request.param == "memory":
        return f"memory://contract-{uuid.uuid4().hex[:8]}", {}
    options = request.getfixturevalue("s3_server")
    return request.getfixturevalue("s3_url"), options


def test_files_round_trip_and_list_with_sizes(backend: tuple[str, dict]) -> None:
    storage = FsspecStorage(*backend)
    assert storage.list_dirs() == [] and storage.list_files("a") == {}
    storage.write_bytes("a/one", b"12345")
    storage.write_bytes("a/two", b"")
    storage.write_bytes("b/three", b"x")
    assert storage.read_bytes("a/one") == b"12345"
    assert storage.list_dirs() == ["a", "b"]
    assert storage.list_files("a") == {"one": 5, "two": 0}
    assert storage.exists("a/one") and not storage.exists("a/none")


def test_overwrite_is_whole_and_remove_tree_is_idempotent(backend: tuple[str, dict]) -> None:
    storage = FsspecStorage(*backend)
    storage.write_bytes("d/f", b"old contents")
    storage.write_bytes("d/f", b"new")
    assert storage.read_bytes("d/f") == b"new"
    storage.remove_tree("d")
    storage.remove_tree("d")
    assert storage.list_dirs() == []
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("d/f")


def test_checkpoints_save_load_and_fall_back(backend: tuple[str, dict]) -> None:
    url, options = backend
    ckpt = Checkpointer(url, storage_options=options, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((64,), float(step)), "epoch": step}, extra={"s": step})
    assert ckpt.wait() is not None
    assert [(i.step, i.committed) for i in ckpt.list()] == [(2, True), (3, True)]
    newest = ckpt.list()[-1]
    ckpt._storage.write_bytes(f"{newest.name}/__0_0.distcp", b"damaged")
    state: dict[str, Any] = {"w": torch.zeros(64), "epoch": 0}
    info = ckpt.load(state)
    assert (info.step, state["epoch"]) == (2, 2) and torch.all(state["w"] == 2.0)
    assert verify(url, options)[0] is False
    with pytest.raises(CorruptShardError):
        ckpt.load(state, name=newest.name)
    ckpt.close()


@pytest.mark.s3
def test_s3_without_valid_credentials_is_a_credentials_error(
        s3_server: dict[str, Any], s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # only 127.0.0.1 is contacted
    options = {**s3_server, "skip_instance_cache": True}
    with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID") as caught:
        FsspecStorage(s3_url, options).write_bytes("x", b"1")
    assert "testing" not in str(caught.value)
    ckpt = Checkpointer(s3_url, storage_options=options)
    ckpt.save(1, {"w": torch.zeros(2)})
    with pytest.raises(CredentialsError):
        ckpt.wait()
