"""Notes other threads leave for the agent's main loop, and the loop's interruptible sleep.

The lease thread (self-fencing), signal handlers and the preemption-notice poller (leave)
and etcd watches (the run changed) never touch the agent's state: they leave a note here
and wake the loop, which takes the notes and decides. Only the loop changes the state.

SIGTERM and SIGINT are a notice: the node leaves at its workers' next step boundary
(:mod:`agents.policy.leaving`), as Kubernetes and Slurm mean it when they send SIGTERM
and wait a grace period. A second signal leaves at once (Ctrl-C twice).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from agents.policy import LeaveNotice


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._dirty = True
        self._leave_signal: int | None = None
        self._notice: LeaveNotice | None = None
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
        """A signal handler: the first signal is a notice to leave at the next step
        boundary; one after a signal's notice leaves at once (a notice from the poller
        stays a notice: a preempted VM's pods get SIGTERM as well)."""
        with self._lock:
            if self._notice is not None and self._notice.signum is not None:
                self._leave_signal = signum
            elif self._notice is None:
                self._notice = LeaveNotice(source=signal.Signals(signum).name, signum=signum)
        self._wake.set()

    def preempted(self, notice: LeaveNotice) -> None:
        """A preemption notice (from the poller's thread): leave at the next step boundary."""
        with self._lock:
            if self._notice is None:
                self._notice = notice
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
        """Leave at once."""
        with self._lock:
            return self._leave_signal

    @property
    def notice(self) -> LeaveNotice | None:
        """Leave at the workers' next step boundary."""
        with self._lock:
            return self._notice

    @property
    def wants_to_leave(self) -> bool:
        with self._lock:
            return self._leave_signal is not None or self._notice is not None

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
