"""Local loads read tensors straight into their targets, hashed in file order, damage caught."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint import local_read, verified_read
from elastic_rt.checkpoint.local_read import _contiguous_start
from elastic_rt.checkpoint.tensor_file import TensorRecord
from elastic_rt.errors import CorruptShardError


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many pieces per tensor, so that both readers take turns at hashing."""
    monkeypatch.setattr(local_read, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(local_read, "DIRECT_MIN_BYTES", 16 << 10)


@pytest.fixture()
def buffered(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys that went through a buffer instead of straight into their target."""
    seen: list[str] = []
    original = verified_read._load_item

    def spy(item: Any, *args: Any) -> None:
        seen.append(item.dest_index.fqn)
        original(item, *args)

    monkeypatch.setattr(verified_read, "_load_item", spy)
    return seen


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"big": torch.randn(64, 256), "wide": torch.randn(3, 8192, dtype=torch.bfloat16),
            "small": torch.randn(7), "step": torch.tensor(3.0)}


def _saved(tmp_path: Path) -> tuple[Checkpointer, Path]:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(1, _state())
    (folder,) = (tmp_path / "ckpt").iterdir()
    return ckpt, folder


def test_large_tensors_are_read_into_their_targets_and_small_ones_through_a_buffer(
        tmp_path: Path, buffered: list[str]) -> None:
    ckpt, _ = _saved(tmp_path)
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    pointers = {k: v.data_ptr() for k, v in target.items()}
    ckpt.load(target)
    assert sorted(buffered) == ["small", "step"]
    assert {k: v.data_ptr() for k, v in target.items()} == pointers
    for key, value in _state().items():
        assert torch.equal(target[key], value), key


def test_a_target_of_another_dtype_or_strides_is_filled_through_a_buffer(
        tmp_path: Path, buffered: list[str]) -> None:
    ckpt, _ = _saved(tmp_path)
    target = {"big": torch.zeros(256, 64).t(), "wide": torch.zeros(3, 8192),
              "small": torch.zeros(7), "step": torch.tensor(0.0)}
    ckpt.load(target)
    assert sorted(buffered) == ["big", "small", "step", "wide"]
    assert torch.equal(target["big"], _state()["big"])
    assert torch.equal(target["wide"], _state()["wide"].float())


@pytest.mark.parametrize("where", [0.3, 0.99])
def test_a_flipped_byte_in_a_tensor_read_in_place_fails_the_check(
        tmp_path: Path, where: float) -> None:
    ckpt, folder = _saved(tmp_path)
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    raw = bytearray(shard.read_bytes())
    raw[int(len(raw) * where)] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match="fails its check"):
        ckpt.load({k: torch.zeros_like(v) for k, v in _state().items()})


def test_a_shard_cut_short_fails_the_check(tmp_path: Path) -> None:
    ckpt, folder = _saved(tmp_path)
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-4096])
    with pytest.raises(CorruptShardError, match="fails its check"):
        ckpt.load({k: torch.zeros_like(v) for k, v in _state().items()})


_RECORD = TensorRecord(torch.float32, (4, 6), (6, 1), 0, 24, 64)


@pytest.mark.parametrize("offsets, lengths, start", [
    ((0, 0), (4, 6), 64),           # the whole chunk
    ((2, 0), (2, 6), 64 + 12 * 4),  # rows: a reshard along the first dim
    ((1, 0), (1, 6), 64 + 6 * 4),
    ((1, 2), (1, 3), 64 + 8 * 4),   # part of one row is still one run of bytes
    ((0, 2), (4, 3), None),         # columns are not
    ((3, 0), (2, 6), None),         # outside the chunk
])
def test_only_a_contiguous_part_of_the_saved_chunk_is_read_in_place(
        offsets: tuple[int, ...], lengths: tuple[int, ...], start: int | None) -> None:
    assert _contiguous_start(_RECORD, offsets, lengths) == start
