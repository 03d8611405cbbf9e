"""Move tensor slices between ranks in waves of bounded size, straight into their places.

What a restore moves (FSDP rows, a pipeline stage's or a tensor-parallel part's regions) is,
for each pair of ranks, a list of slices on the sender and the list of places they go on the
receiver, in the same order. Packing every pair's slices into one buffer and exchanging them
in one all-to-all held three to four extra copies of all of it at once (the packed slices,
their concatenation, the received buffer): at 1.2 GB of state hundreds of MB per rank, and
the issue's bound is 256 MB whatever the model. Here each pair's bytes travel in waves: in
wave ``w`` every pair carries its bytes ``[w * chunk, (w + 1) * chunk)``, packed from the
slices, exchanged by one all-to-all (which waits through the round's notice), and written
into the places. Peak extra memory: one wave's buffers, at most :data:`WAVE_BYTES` per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_rt.worker import abort

WAVE_BYTES = 128 << 20
"""The most one wave's buffers hold on a rank, what it sends and receives together. Half
the issue's bound: a restore also writes the new state's pages and a few small buffers
(a 1.2 GB FSDP restore peaked 164 MB beyond its new state with this, 294 MB with 256)."""

_MIN_CHUNK = 1 << 20


def exchange_slices(sends: list[list[torch.Tensor]], places: list[list[torch.Tensor]],
                    group: dist.ProcessGroup) -> None:
    """Copy ``sends[r]`` (this rank's slices for rank ``r``, in order) into the places rank
    ``r`` names for them, and what each rank ``r`` sends here into ``places[r]``, byte for
    byte (each place is a view of the tensor it fills, of the sender's slice's size and
    dtype; a rank's slices for itself go the same way). Collective over ``group``.

    Raises:
        RoundAbandoned: a newer round dropped a member while this waited.
        RuntimeError: a peer's connection failed.
    """
    out = [_Stream(slices) for slices in sends]
    into = [_Stream(slices) for slices in places]
    peers = sum(1 for stream in out if stream.size) + sum(1 for stream in into if stream.size)
    largest = max([stream.size for stream in (*out, *into)] or [0])
    agreed = torch.tensor([largest, peers], dtype=torch.int64)
    work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True)
    assert work is not None  # async_op=True always returns a Work
    abort.wait(work.get_future())
    largest, peers = (int(v) for v in agreed)
    if not largest:
        return
    chunk = max(_MIN_CHUNK, WAVE_BYTES // max(1, peers))  # the same on every rank
    for start in range(0, largest, chunk):
        send_sizes = [stream.part(start, chunk) for stream in out]
        receive_sizes = [stream.part(start, chunk) for stream in into]
        outgoing = torch.empty(sum(send_sizes), dtype=torch.uint8)
        at = 0
        for stream, size in zip(out, send_sizes):
            stream.read(start, outgoing[at:at + size])
            at += size
        incoming = torch.empty(sum(receive_sizes), dtype=torch.uint8)
        work = dist.all_to_all_single(incoming, outgoing, output_split_sizes=receive_sizes,
                                      input_split_sizes=send_sizes, group=group,
                                      async_op=True)
        assert work is not None
        abort.wait(work.get_future())
        at = 0
        for stream, size in zip(into, receive_sizes):
            stream.write(start, incoming[at:at + size])
            at += size


class _Stream:
    """One pair's slices seen as one run of bytes, read or written a part at a time.

    A slice that is not contiguous is read through a contiguous copy, and written through
    one that goes into place once its last byte has arrived (only that slice is staged)."""

    def __init__(self, slices: list[torch.Tensor]) -> None:
        self.slices = slices
        self.offsets: list[int] = []
        self.size = 0
        for tensor in slices:
            self.offsets.append(self.size)
            self.size += tensor.numel() * tensor.element_size()
        self._staged: dict[int, torch.Tensor] = {}

    def part(self, start: int, chunk: int) -> int:
        """How many of this stream's bytes wave ``[start, start + chunk)`` carries."""
        return max(0, min(self.size, start + chunk) - start)

    def _spans(self, start: int, size: int) -> list[tuple[int, int, int, int]]:
        """(slice, first byte in it, end byte in it, offset in the part) for the slices
        that bytes ``[start, start + size)`` of the stream cover."""
        spans, stop = [], start + size
        for index, (offset, tensor) in enumerate(zip(self.offsets, self.slices)):
            end = offset + tensor.numel() * tensor.element_size()
            lo, hi = max(start, offset), min(stop, end)
            if lo < hi:
                spans.append((index, lo - offset, hi - offset, lo - start))
        return spans

    def read(self, start: int, into: torch.Tensor) -> None:
        for index, lo, hi, at in self._spans(start, into.numel()):
            tensor = self.slices[index]
            if not tensor.is_contiguous():
                if index not in self._staged:  # one copy for all the waves it spans
                    self._staged[index] = tensor.contiguous()
                tensor = self._staged[index]
            into[at:at + hi - lo].copy_(_bytes(tensor)[lo:hi])
            if hi == tensor.numel() * tensor.element_size():
                self._staged.pop(index, None)

    def write(self, start: int, data: torch.Tensor) -> None:
        for index, lo, hi, at in self._spans(start, data.numel()):
            place = self.slices[index]
            if not place.is_contiguous() and index not in self._staged:
                self._staged[index] = torch.empty(place.shape, dtype=place.dtype)
            target = place if place.is_contiguous() else self._staged[index]
            _bytes(target)[lo:hi].copy_(data[at:at + hi - lo])
            if target is not place and hi == place.numel() * place.element_size():
                place.copy_(self._staged.pop(index))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat view."""
    return tensor.detach().reshape(-1).view(torch.uint8)
