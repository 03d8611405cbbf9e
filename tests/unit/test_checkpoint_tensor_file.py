"""Decoding DCP tensor items in place: same tensors as torch.load, nothing executed."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from elastic_rt.checkpoint.tensor_file import decode_in_place, locate


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


def test_a_tensor_is_located_from_the_head_and_tail_of_its_record_alone() -> None:
    view = _saved(torch.randn(64, 64))
    head, tail = view[:4096], view[-4096:]
    length = len(view)

    def read(start: int, size: int) -> memoryview:
        if start + size <= len(head):
            return head[start:start + size]
        if start >= length - len(tail):
            return tail[start - (length - len(tail)):][:size]
        raise IndexError(start)

    found = locate(read, length)
    whole = decode_in_place(view)
    assert found is not None and whole is not None
    assert (found.dtype, found.size, found.stride, found.numel) == (
        torch.float32, (64, 64), (64, 1), 64 * 64)
    base = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert whole.data_ptr() - base == found.start
