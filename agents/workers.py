"""Start, watch and stop one node's worker processes. Never leaves orphans.

Each worker runs in its own session (its own process group), so a signal meant
for one worker's tree reaches all of it and nothing else, and gets SIGKILL when
the agent dies (a parent-death signal, see :mod:`elastic_rt.childproc`). Stopping is SIGTERM to
the group, then SIGKILL after a grace period, then a sweep of any descendant
that escaped into another group (found with psutil).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import psutil

from elastic_rt.childproc import dying_with_parent

logger = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class WorkerExit:
    local_rank: int
    pid: int
    exitcode: int
    """Negative for a signal, as in subprocess."""


class WorkerGroup:
    """The local workers of one round.

    Thread-safe: the lease keeper may call :meth:`stop` while the agent polls.
    """

    def __init__(self, grace_period: float = 5.0) -> None:
        self.grace_period = grace_period
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs]

    def start(self, command: list[str], envs: list[dict[str, str]]) -> list[int]:
        """Start one worker per environment; returns their PIDs."""
        with self._lock:
            if any(p.poll() is None for p in self._procs):
                raise RuntimeError("workers still running; stop them first")
            self._procs = [
                subprocess.Popen(
                    dying_with_parent(command), env=env, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                for env in envs
            ]
            return [p.pid for p in self._procs]

    def poll(self) -> tuple[WorkerState, list[WorkerExit]]:
        """The group's state and the exits seen so far."""
        with self._lock:
            if not self._procs:
                return WorkerState.IDLE, []
            codes = [p.poll() for p in self._procs]
            exits = [
                WorkerExit(i, p.pid, code)
                for i, (p, code) in enumerate(zip(self._procs, codes))
                if code is not None
            ]
        if any(e.exitcode != 0 for e in exits):
            return WorkerState.FAILED, exits
        if len(exits) == len(codes):
            return WorkerState.SUCCEEDED, exits
        return WorkerState.RUNNING, exits

    def stop(self) -> None:
        """SIGTERM every worker's group, SIGKILL after the grace period, reap all."""
        with self._lock:
            procs, self._procs = self._procs, []
        if not procs:
            return
        descendants = _descendants(procs)
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        for child in descendants:
            try:
                child.kill()
            except psutil.Error:
                pass
        logger.info("stopped workers %s", [p.pid for p in procs])


def _descendants(procs: list[subprocess.Popen[bytes]]) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for proc in procs:
        try:
            found.extend(psutil.Process(proc.pid).children(recursive=True))
        except psutil.Error:
            continue
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
