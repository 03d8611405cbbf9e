"""Asynchronous saves: stage to CPU memory in the caller, write in one background thread.

The caller blocks only while tensors are copied into CPU staging buffers. The
buffers are kept and reused from save to save, so steady-state staging allocates
nothing and holds at most one extra copy of the state (1x its size). One write is in
flight at a time: the next save first waits for the previous one, because the
previous write still reads the staging buffers.

CUDA tensors are staged through pinned (page-locked) host buffers with ``non_blocking``
copies, queued on each device's current stream: the caller pays for queueing them, not
for the transfer. Training kernels queued after them on that stream (the next optimizer
step) run after the copies, so the staged values are those of the save's step. The
background write waits for a CUDA event recorded after the copies
(:meth:`Staged.wait_copied`) before it reads a buffer.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Staged:
    """CPU copies of a save's tensors, and the CUDA events that mark their copies done.

    ``events`` is empty when every tensor came from the CPU (its copy is done already).
    """

    tensors: dict[str, torch.Tensor]
    events: tuple[torch.cuda.Event, ...] = ()

    def wait_copied(self) -> None:
        """Block until every device-to-host copy has landed (a no-op for CPU tensors)."""
        for event in self.events:
            event.synchronize()


class Stager:
    """Copies a flat tensor dict into reusable CPU buffers (DTensors stay DTensors)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tensors: dict[str, torch.Tensor]) -> Staged:
        """CPU copies of ``tensors`` that later training steps cannot change.

        Copies from a GPU may still be in flight: call :meth:`Staged.wait_copied`
        before reading the copies.
        """
        for stale in set(self._buffers) - set(tensors):
            del self._buffers[stale]
        staged = {key: self._stage_one(key, tensor) for key, tensor in tensors.items()}
        devices = {_local(t).device for t in tensors.values() if _local(t).is_cuda}
        events = []
        for device in sorted(devices, key=str):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return Staged(staged, tuple(events))

    def _stage_one(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype \
                or buffer.is_pinned() != local.is_cuda:
            buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                 pin_memory=should_pin(local))
            self._buffers[key] = buffer
        # From pinned memory the copy is asynchronous; from a CPU tensor it is plain.
        buffer.copy_(local.detach(), non_blocking=local.is_cuda)
        if not isinstance(tensor, DTensor):
            return buffer
        # Same spec (mesh, placements, global shape), the staging buffer as its local
        # tensor. Not DTensor.from_local: it moves the local tensor to the mesh's device,
        # which for a CUDA mesh puts the staged copy back on the GPU. torch's own async
        # staging (_state_dict_utils._create_cpu_state_dict) swaps the local tensor too.
        return DTensor(buffer, tensor._spec, requires_grad=False)


def should_pin(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s staging buffer is page-locked: exactly when it is on a GPU."""
    return tensor.is_cuda


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class BackgroundWriter:
    """One worker thread running at most one write at a time."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def submit(self, job: Callable[[], T]) -> None:
        """Start ``job``; the previous one must have been collected with :meth:`wait`."""
        if self._pending is not None:
            raise RuntimeError("a background write is still in flight; wait() first")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._pending = self._executor.submit(job)

    @property
    def is_busy(self) -> bool:
        """Whether a write is still running (a finished one not yet collected is not)."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> object | None:
        """Block until the write in flight ends; return its result or raise its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
