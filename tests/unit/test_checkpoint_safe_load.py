"""Loading never runs pickled code from storage: planted payloads stay inert."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint.safe_pickle import load_metadata
from elastic_rt.errors import CorruptShardError
from tests.checkpoint_tamper import plant


class _Payload:
    """Unpickling this would create ``path``: proof that pickled code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.path,))


def _saved(tmp_path: Path) -> tuple[Checkpointer, Path]:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(1, {"w": torch.arange(6.0), "lr": 0.5})
    (folder,) = (tmp_path / "ckpt").iterdir()
    return ckpt, folder


def test_real_dcp_metadata_passes_the_allow_list(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path)
    metadata = load_metadata((folder / ".metadata").read_bytes(), "m")
    assert set(metadata.state_dict_metadata) == {"w"}


def test_a_payload_in_metadata_bytes_is_refused_and_does_not_run(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    with pytest.raises(CorruptShardError, match="posix.mkdir|refused"):
        load_metadata(pickle.dumps(_Payload(target)), "planted")
    assert not target.exists()


def test_metadata_that_is_not_a_metadata_object_is_refused() -> None:
    with pytest.raises(CorruptShardError, match="holds a dict"):
        load_metadata(pickle.dumps({"a": 1}), "planted")


def test_a_payload_planted_in_dot_metadata_does_not_run_on_load(tmp_path: Path) -> None:
    ckpt, folder = _saved(tmp_path)
    target = tmp_path / "pwned"
    plant(folder, ".metadata", pickle.dumps(_Payload(target)))
    with pytest.raises(CorruptShardError, match=".metadata is not plain checkpoint metadata"):
        ckpt.load({"w": torch.zeros(6), "lr": 0.0})
    assert not target.exists()


def test_a_payload_planted_in_a_state_file_does_not_run_on_load(tmp_path: Path) -> None:
    ckpt, folder = _saved(tmp_path)
    target = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"x": _Payload(target)}, buffer)
    data_file = next(p.name for p in folder.iterdir() if p.suffix == ".distcp")
    metadata = load_metadata((folder / ".metadata").read_bytes(), "m")
    # Point the item at the planted bytes so that the reader does try to decode them.
    (info,) = metadata.storage_data.values()
    info.offset, info.length = 0, len(buffer.getvalue())
    plant(folder, data_file, buffer.getvalue())
    plant(folder, ".metadata", pickle.dumps(metadata))
    with pytest.raises(CorruptShardError, match="not a plain tensor and was refused"):
        ckpt.load({"w": torch.zeros(6), "lr": 0.0})
    assert not target.exists()


def test_a_state_file_changed_without_the_manifest_fails_its_checksum(tmp_path: Path) -> None:
    ckpt, folder = _saved(tmp_path)
    data_file = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte in tensor data; DCP alone would load it silently
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match=f"{data_file.name} fails its check"):
        ckpt.load({"w": torch.zeros(6), "lr": 0.0})


def test_metadata_declaring_a_tensor_as_a_pickled_object_is_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ckpt, folder = _saved(tmp_path)
    metadata = load_metadata((folder / ".metadata").read_bytes(), "m")
    metadata.state_dict_metadata["w"] = BytesStorageMetadata()
    plant(folder, ".metadata", pickle.dumps(metadata))
    with pytest.raises(CorruptShardError, match="'w' is a BytesStorageMetadata, not a tensor"):
        ckpt.load({"w": torch.zeros(6), "lr": 0.0})
