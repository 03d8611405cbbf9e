"""Asynchronous saves: stage to CPU memory in the caller, write in one background thread.

The caller blocks only while tensors are copied into CPU staging buffers. The
buffers are kept and reused from save to save, so steady-state staging allocates
nothing and holds at most one extra copy of the state (1x its size); the elastic loop
has the first save's made ahead (:meth:`Stager.reserve`: on a thread of its own beside
the first steps, or in a standby worker before its node registers), so that no save
faults fresh memory in. One write is in
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
import threading
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
        self._reserving: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        self._reserved()
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def reserve(self, tensors: dict[str, torch.Tensor], *, background: bool = True) -> bool:
        """Allocate and fault in the buffers that :meth:`stage` would make for ``tensors``,
        on a thread of its own unless ``background`` is False; whether there were any to
        make.

        Why: the first save made them in the training thread, and faulting in a state's
        size of fresh memory is most of its cost (1.2 GB at 0.6 CPU: the first save
        blocked 5.2 s, the next 0.5 s). Made ahead, they cost the same memory from the
        start instead of from the first save, and the save only copies.
        """
        self._reserved()
        missing = {key: (_local(t).shape, _local(t).dtype, should_pin(_local(t)))
                   for key, t in tensors.items() if not self._fits(key, _local(t))}
        if not missing:
            return False

        def make() -> None:
            for key, (shape, dtype, pin) in missing.items():
                self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=pin).fill_(0)

        if not background:
            make()
            return True
        self._reserving = threading.Thread(target=make, name="ckpt-stage-reserve", daemon=True)
        self._reserving.start()
        return True

    def _reserved(self) -> None:
        """Wait for buffers being reserved: only then is ``_buffers`` this thread's."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _fits(self, key: str, local: torch.Tensor) -> bool:
        buffer = self._buffers.get(key)
        return (buffer is not None and buffer.shape == local.shape and buffer.dtype == local.dtype
                and buffer.is_pinned() == should_pin(local))

    def stage(self, tensors: dict[str, torch.Tensor]) -> Staged:
        """CPU copies of ``tensors`` that later training steps cannot change.

        Copies from a GPU may still be in flight: call :meth:`Staged.wait_copied`
        before reading the copies.
        """
        self._reserved()
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
        if not self._fits(key, local):
            self._buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                             pin_memory=should_pin(local))
        buffer = self._buffers[key]
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
