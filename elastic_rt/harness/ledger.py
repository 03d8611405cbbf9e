"""A ledger of every process a test, benchmark or chaos trial started, and their descendants.

Agents start their workers in sessions of their own, so killing a root's process
group does not reach them; and a worker that outlives its agent is exactly the bug
the suite looks for. So the ledger remembers each descendant it ever saw, by
``(pid, create time)`` so a recycled PID is never taken for ours, and on
:meth:`ProcessLedger.close` kills every group it started (by PGID, after SIGCONT, so
a stopped tree dies too), then every remembered descendant still alive. Nothing is
ever killed by name.

Descendants are seen when :meth:`~ProcessLedger.sample` runs: on every
:meth:`~ProcessLedger.tree` call, at close, and every ``sample_every`` seconds from a
background thread when that is set (workers of earlier rounds come and go between
explicit calls).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Sequence

import psutil

from elastic_rt.harness.waits import WaitTimeout, wait_until

_REAP_TIMEOUT_S = 10.0


class ProcessLedger:
    """Starts commands in new sessions; remembers their trees; kills them all on close."""

    def __init__(self, *, sample_every: float | None = None) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self._roots: list[psutil.Process] = []
        self._seen: dict[tuple[int, float], psutil.Process] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        if sample_every is not None:
            self._sampler = threading.Thread(target=self._sample_loop, args=(sample_every,),
                                             name="process-ledger", daemon=True)
            self._sampler.start()

    # starting -------------------------------------------------------------------------
    def start(self, args: Sequence[str], *, env: dict[str, str] | None = None,
              log: str | Path | None = None, cwd: str | Path | None = None,
              ) -> subprocess.Popen[bytes]:
        """Run ``args`` in a new session (its PGID is its PID), output appended to ``log``."""
        out = open(log, "ab") if log is not None else None
        try:
            proc = subprocess.Popen(
                list(args), env=env, cwd=cwd, stdout=out or subprocess.DEVNULL,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        finally:
            if out is not None:
                out.close()
        self.procs.append(proc)
        self.adopt(proc.pid)
        return proc

    def adopt(self, pid: int) -> None:
        """Track ``pid`` (started elsewhere, e.g. an etcd server) and its descendants too."""
        try:
            proc = psutil.Process(pid)
            key = (pid, proc.create_time())
        except psutil.Error:
            return
        with self._lock:
            self._roots.append(proc)
            self._seen.setdefault(key, proc)
        self.sample()

    # looking --------------------------------------------------------------------------
    def sample(self) -> None:
        """Remember every current descendant of every root."""
        with self._lock:
            roots = list(self._roots)
        for root in roots:
            if not _running(root):
                continue  # gone: its PID may be someone else's by now
            with contextlib.suppress(psutil.Error):
                self._remember(root.children(recursive=True))

    def tree(self, pid: int) -> list[psutil.Process]:
        """``pid`` and its descendants now (remembered for the final sweep); [] if gone."""
        try:
            root = psutil.Process(pid)
            found = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        self._remember(found)
        return found

    def alive(self) -> list[psutil.Process]:
        """Every process ever seen that still runs (zombies count as gone)."""
        with self._lock:
            procs = list(self._seen.values())
        return [p for p in procs if _running(p)]

    @property
    def seen_count(self) -> int:
        """How many distinct processes the ledger has seen so far."""
        with self._lock:
            return len(self._seen)

    def seen_pids(self) -> set[int]:
        """The PIDs of every process the ledger has seen so far, alive or not."""
        with self._lock:
            return {pid for pid, _ in self._seen}

    # signalling -----------------------------------------------------------------------
    def signal_tree(self, pid: int, sig: int) -> float:
        """Send ``sig`` to every process group of ``pid``'s tree at once.

        Workers live in their own sessions, so "the node" is every group in the tree,
        not only the root's. Returns ``time.time()`` taken right before the first
        ``killpg``.
        """
        groups: list[int] = []
        for proc in self.tree(pid):
            with contextlib.suppress(psutil.Error, OSError):
                pgid = os.getpgid(proc.pid)
                if pgid not in groups:
                    groups.append(pgid)
        stamp = time.time()
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        return stamp

    def close(self) -> None:
        """SIGKILL every group started and every descendant seen; reap; stop sampling.

        Returns once they are gone (descendants are not ours to reap: their new
        parent does), or after a deadline, leaving :meth:`alive` to tell.
        """
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=2)
        self.sample()
        for proc in self.procs:
            if proc.returncode is not None:
                continue  # reaped: its PID (= PGID) may belong to someone else by now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
        for seen in self.alive():
            with contextlib.suppress(psutil.Error):
                seen.resume()
                seen.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_REAP_TIMEOUT_S)
        with contextlib.suppress(WaitTimeout):
            wait_until(lambda: not self.alive(), _REAP_TIMEOUT_S, "killed processes gone",
                       interval=0.01)

    # internals ------------------------------------------------------------------------
    def _remember(self, procs: list[psutil.Process]) -> None:
        for proc in procs:
            try:
                key = (proc.pid, proc.create_time())
            except psutil.Error:
                continue
            with self._lock:
                self._seen.setdefault(key, proc)

    def _sample_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self.sample()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
