"""The process layer: start, watch and stop one node's worker processes. Never leaves orphans.

Each worker runs in its own session (its own process group), so a signal meant
for one worker's tree reaches all of it and nothing else, and gets SIGKILL when
the agent dies (a parent-death signal, see :mod:`elastic_rt.childproc`). Stopping is SIGTERM to
the group, then SIGKILL after a grace period, then a sweep of any descendant
that escaped into another group (found with psutil).

Output follows torchrun's ``--redirects``/``--tee`` plan (:mod:`agents.output`): a
redirected stream goes straight to its file; a tee'd one through a pipe that a
thread copies to the file and, prefixed with ``[<role><local_rank>]:``, to ours.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import tempfile
import time
from typing import IO

import psutil

from agents.output import OutputSpec, Streams, plan_streams
from agents.worker_env import with_extras
from agents.worker_state import WorkerExit, WorkerState
from elastic_rt.childproc import dying_with_parent

logger = logging.getLogger(__name__)


class WorkerGroup:
    """The local workers of one round.

    Thread-safe: the lease keeper may call :meth:`stop` while the agent polls.
    """

    def __init__(
        self,
        grace_period: float = 5.0,
        output: OutputSpec | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.grace_period = grace_period
        self.output = output or OutputSpec()
        self._log_dir = self.output.log_dir or log_dir
        self._run_dir: str | None = None
        self._attempt = -1
        self._procs: list[subprocess.Popen[bytes]] = []
        self.error_files: list[str] = []
        """Per local rank, where the current workers' error files go (torchrun's layout)."""
        self._tees: list[threading.Thread] = []
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
            plans = plan_streams(self.output, len(envs), self._next_attempt_dir())
            self._procs = [self._spawn(command, env, plan) for env, plan in zip(envs, plans)]
            self.error_files = [plan.error_file for plan in plans]
            return [p.pid for p in self._procs]

    def _next_attempt_dir(self) -> str:
        """torchrun's ``attempt_<n>`` under one directory per group (never reused)."""
        if self._run_dir is None:
            self._run_dir = tempfile.mkdtemp(prefix="workers_", dir=self._log_dir)
        self._attempt += 1
        return os.path.join(self._run_dir, f"attempt_{self._attempt}")

    def _spawn(
        self, command: list[str], env: dict[str, str], plan: Streams
    ) -> subprocess.Popen[bytes]:
        os.makedirs(os.path.dirname(plan.error_file), exist_ok=True)
        env = with_extras(env, error_file=plan.error_file, role=self.output.role)
        out = _destination(plan.stdout_file, plan.show_stdout)
        err = _destination(plan.stderr_file, plan.show_stderr)
        proc = subprocess.Popen(
            dying_with_parent(command), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            start_new_session=True,
        )  # fmt: skip
        for dest in (out, err):
            if not isinstance(dest, int) and dest is not None:
                dest.close()  # the child holds its own copy
        for pipe, path, console in ((proc.stdout, plan.stdout_file, sys.stdout),
                                    (proc.stderr, plan.stderr_file, sys.stderr)):  # fmt: skip
            if pipe is not None and path is not None:
                args = (pipe, path, console, plan.prefix)
                tee = threading.Thread(target=_tee, args=args, daemon=True)
                tee.start()
                self._tees.append(tee)
        return proc

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

    def stop(self, *, grace: bool = True) -> list[WorkerExit]:
        """SIGTERM every worker's group, SIGKILL after the grace period, reap all.

        ``grace=False`` skips the SIGTERM and the wait (workers whose peers are gone).
        Returns how each worker ended (empty when none ran).
        """
        with self._lock:
            procs, self._procs = self._procs, []
        if not procs:
            return []
        descendants = _descendants(procs)
        if grace:
            self._terminate(procs)
        for proc in procs:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        for child in descendants:
            try:
                child.kill()
            except psutil.Error:
                pass
        logger.info("stopped workers %s", [p.pid for p in procs])
        self._join_tees()
        return [WorkerExit(i, p.pid, p.returncode) for i, p in enumerate(procs)]

    def _terminate(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """SIGTERM each group and wait up to the grace period for them to exit."""
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _join_tees(self) -> None:
        """Let tee threads copy what the workers wrote last (their pipes are at EOF now)."""
        deadline = time.monotonic() + 2.0
        tees, self._tees = self._tees, []
        for tee in tees:
            tee.join(timeout=max(0.0, deadline - time.monotonic()))


def _destination(path: str | None, shown: bool) -> int | IO[bytes] | None:
    """Popen's target for one stream: inherit ours, a file, a tee pipe, or nothing."""
    if path is None:
        return None if shown else subprocess.DEVNULL
    if shown:
        return subprocess.PIPE
    return open(path, "ab")


def _tee(pipe: IO[bytes], path: str, console: IO[str], prefix: str) -> None:
    """Copy a worker's stream line by line to its log file and, prefixed, to ours."""
    with pipe, open(path, "ab") as log:
        for line in pipe:
            log.write(line)
            log.flush()
            console.write(f"{prefix}{line.decode(errors='replace')}")
            console.flush()


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
