"""Notes other threads leave for the agent's main loop, and the loop's interruptible sleep.

The lease thread (self-fencing), signal handlers (leave) and etcd watches (the run
changed) never touch the agent's state: they leave a note here and wake the loop,
which takes the notes and decides. Only the loop changes the state.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._dirty = True
        self._leave_signal: int | None = None
        self._fenced = False

    def changed(self) -> None:
        """The run's keys changed: re-read them."""
        with self._lock:
            self._dirty = True
        self._wake.set()

    def reread(self) -> None:
        """Re-read the run next time (this loop wrote to it), without cutting a sleep short."""
        with self._lock:
            self._dirty = True

    def leave(self, signum: int, _frame: FrameType | None = None) -> None:
        """Leave gracefully (a signal handler)."""
        with self._lock:
            self._leave_signal = signum
        self._wake.set()

    def leave_on_signals(self) -> None:
        """SIGTERM and SIGINT make a graceful leave (only the main thread may install them)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.leave)
            signal.signal(signal.SIGINT, self.leave)

    def fenced(self) -> None:
        """The lease thread stopped the workers; the loop records it in its state."""
        with self._lock:
            self._fenced = True
        self._wake.set()

    @property
    def leave_signal(self) -> int | None:
        with self._lock:
            return self._leave_signal

    def take_fenced(self) -> bool:
        with self._lock:
            fenced, self._fenced = self._fenced, False
            return fenced

    @property
    def dirty(self) -> bool:
        with self._lock:
            return self._dirty

    def mark_read(self) -> None:
        with self._lock:
            self._dirty = False

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` or until a note arrives."""
        self._wake.wait(seconds)
        self._wake.clear()
