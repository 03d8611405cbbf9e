"""Decoding DCP tensor items in place: same tensors as torch.load, nothing executed."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from elastic_rt.checkpoint.tensor_file import decode_in_place


def _saved(obj: object) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return memoryview(bytearray(buffer.getvalue()))


@pytest.mark.parametrize("tensor", [
    torch.randn(5, 3), torch.arange(12).reshape(3, 4).t(), torch.tensor([True, False]),
    torch.randn(4, dtype=torch.bfloat16), torch.zeros(0, 3), torch.tensor(2.5),
    torch.randn(6)[2:5],
])
def test_in_place_decoding_equals_torch_load(tensor: torch.Tensor) -> None:
    view = _saved(tensor)
    decoded = decode_in_place(view)
    assert decoded is not None
    assert decoded.dtype == tensor.dtype and torch.equal(decoded, tensor)
    assert decoded.stride() == torch.load(io.BytesIO(view), weights_only=True).stride()


def test_the_decoded_tensor_views_the_buffer_without_a_copy() -> None:
    view = _saved(torch.zeros(4))
    decoded = decode_in_place(view)
    assert decoded is not None
    base = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert base <= decoded.data_ptr() < base + len(view)


def test_dtypes_saved_as_untyped_storage_fall_back_to_torch_load() -> None:
    assert decode_in_place(_saved(torch.zeros(3, dtype=torch.float8_e4m3fn))) is None


class _Payload:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.path,))


def test_a_planted_payload_is_not_run(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    assert decode_in_place(_saved({"x": _Payload(target)})) is None
    assert decode_in_place(memoryview(bytearray(b"not a zip"))) is None
    assert not target.exists()
