"""Shared pieces of the process benchmarks: process trees, JSON-lines tails, tables.

Every process a benchmark starts goes through :class:`Procs`, which starts it in
its own session and, on :meth:`Procs.close` (also on Ctrl-C or SIGTERM, see
:func:`interruptible`), kills every process group it started and every descendant
it has seen, so no agent, worker or etcd outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import psutil

from elastic_rt.events import JsonLinesTail

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


class Procs:
    """Starts commands in new sessions; kills their whole trees when closed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self._seen: dict[int, psutil.Process] = {}

    def start(self, args: Sequence[str], *, env: dict[str, str] | None = None,
              log: Path | None = None) -> subprocess.Popen[bytes]:
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(list(args), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log:
                out.close()
        self.procs.append(proc)
        return proc

    def tree(self, pid: int) -> list[psutil.Process]:
        """``pid`` and its descendants now (remembered for the final sweep)."""
        try:
            root = psutil.Process(pid)
            found = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for p in found:
            self._seen[p.pid] = p
        return found

    def signal_tree(self, pid: int, sig: int) -> float:
        """Send ``sig`` to every process group of ``pid``'s tree at once.

        Workers live in their own sessions (agents start them that way), so
        killing "the node" means every group in the tree, not only the root's.
        Returns ``time.time()`` taken right before the first ``killpg``.
        """
        groups = []
        for p in self.tree(pid):
            with contextlib.suppress(psutil.Error):
                pgid = os.getpgid(p.pid)
                if pgid not in groups:
                    groups.append(pgid)
        stamp = time.time()
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        return stamp

    def close(self) -> None:
        """SIGKILL every group started and every descendant seen; reap."""
        for proc in self.procs:
            self.tree(proc.pid)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
        for p in self._seen.values():
            with contextlib.suppress(psutil.Error):
                p.resume()
                p.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs.clear()
        self._seen.clear()


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt, so ``finally`` blocks clean up on both."""

    def on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class JsonLines(JsonLinesTail):
    """A :class:`~elastic_rt.events.JsonLinesTail` that also keeps every row it read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.rows: list[dict] = []

    def poll(self) -> list[dict]:
        new = super().poll()
        self.rows.extend(new)
        return new


def wait_for(condition: Callable[[], object], timeout: float, what: str,
             interval: float = 0.02) -> object:
    """Poll ``condition`` until truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def env_with_repo(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ELASTIC_RT_LOG_LEVEL", "INFO")
    env.update(extra)
    return env


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width text table."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line("-" * w for w in widths), *(line(r) for r in rows)])
