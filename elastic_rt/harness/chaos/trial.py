"""One chaos trial: its etcd, folder and process ledger, its jobs, and what it found.

A :class:`Job` is one run id on the trial's etcd: it starts ``elastic-rt launch``
nodes through the trial's :class:`~elastic_rt.harness.ProcessLedger`, reads their
event log as it grows, and injects the process faults (SIGKILL a node). The
:class:`Trial` collects problems (anything that fails the trial), notes and the
fault-specific checks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.events import Event, JsonLinesTail
from elastic_rt.harness.chaos.config import SCRIPT, ChaosConfig
from elastic_rt.harness.env import PYTHON, child_env
from elastic_rt.harness.ledger import ProcessLedger
from elastic_rt.harness.waits import WaitTimeout, wait_until

logger = logging.getLogger("chaos")

_POLL_S = 0.02


class EventTail:
    """The events of a JSON-lines file so far, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[Event] = []
        self._tail = JsonLinesTail(path)

    def read(self) -> list[Event]:
        for row in self._tail.poll():
            try:
                self.events.append(Event(**row))
            except TypeError:
                continue  # not an event
        return self.events


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    killed: bool = False
    """Taken out by the harness (killed, or told to leave): not expected to finish."""


class Job:
    """One run id on an etcd: its nodes, event log, output and checkpoint folder."""

    def __init__(self, trial: Trial, run_id: str, *, nnodes: str = "1:3",
                 checkpoint: bool = False, endpoint: str | None = None,
                 lease_ttl: int | None = None, step_time: float | None = None) -> None:
        self.trial, self.run_id, self.nnodes = trial, run_id, nnodes
        self.lease_ttl = lease_ttl or trial.cfg.lease_ttl
        self.step_time = trial.cfg.step_time if step_time is None else step_time
        self.dir = trial.dir / run_id
        self.dir.mkdir(parents=True)
        self.out = self.dir / "params.pt"
        self.ckpt_dir = self.dir / "ckpt" if checkpoint else None
        self.endpoint = endpoint or trial.etcd.endpoint
        self.tail = EventTail(self.dir / "events.jsonl")
        self.nodes: dict[str, Node] = {}
        self.started = time.monotonic()

    def start_node(self, name: str, *, prefix: tuple[str, ...] = (), host: str | None = None,
                   env: dict[str, str] | None = None) -> Node:
        cfg = self.trial.cfg
        args = [
            *prefix, PYTHON, "-m", "elastic_rt.cli", "launch",
            "--nnodes", self.nnodes, "--nproc-per-node", "1",
            "--rdzv-endpoint", f"etcd://{self.endpoint}", "--run-id", self.run_id,
            "--node-id", name, "--events-file", str(self.tail.path),
            "--lease-ttl", str(self.lease_ttl), "--last-call", "5",
            "--max-restarts", str(cfg.max_restarts),
            *(("--local-addr", host) if host else ()),
            SCRIPT, "--steps", str(cfg.steps), "--out", str(self.out),
            "--step-time", str(self.step_time), *cfg.script_args,
        ]  # fmt: skip
        if self.ckpt_dir is not None:
            args += ["--checkpoint", f"file://{self.ckpt_dir}", "--every", str(cfg.every)]
        full_env = child_env(ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC=str(cfg.collective_timeout))
        full_env.update(env or {})
        proc = self.trial.ledger.start(args, env=full_env, log=self.dir / f"{name}.log")
        node = Node(name, proc)
        self.nodes[name] = node
        return node

    def start(self, names: str = "abc", **kwargs: Any) -> None:
        for name in names:
            self.start_node(name, **kwargs)

    # observation --------------------------------------------------------------------
    def events(self) -> list[Event]:
        return self.tail.read()

    def step(self) -> int:
        """The newest step rank 0 completed."""
        return max((e.step or 0 for e in self.events()
                    if e.name == "step.completed" and e.rank == 0), default=0)

    def round(self) -> int:
        return max((e.round for e in self.events() if e.name == "round.formed"
                    and e.round is not None), default=-1)

    def live(self) -> list[str]:
        return [n.name for n in self.nodes.values() if not n.killed and n.proc.poll() is None]

    def worker_pids(self, name: str) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.nodes[name].proc.pid).children()]
        except psutil.Error:
            return []

    def tree(self, name: str) -> list[int]:
        """The node's agent and all its descendants."""
        pid = self.nodes[name].proc.pid
        return [p.pid for p in self.trial.ledger.tree(pid)] or [pid]

    # faults ---------------------------------------------------------------------------
    def signal_node(self, name: str, sig: int) -> None:
        """``sig`` to every process group of the node at once: agent and workers."""
        self.trial.ledger.signal_tree(self.nodes[name].proc.pid, sig)

    def kill_node(self, name: str) -> None:
        """SIGKILL the whole node at once: agent and workers."""
        self.signal_node(name, signal.SIGKILL)
        self.nodes[name].killed = True
        self.nodes[name].proc.wait()
        self.trial.note(f"{self.run_id}: SIGKILL node {name} at step {self.step()}")

    def kill_workers(self, name: str) -> list[int]:
        """SIGKILL the node's worker processes only (its agent restarts them); their PIDs."""
        pids = self.worker_pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def leave_node(self, name: str, timeout: float = 60.0) -> int | None:
        """SIGTERM the node's agent only: it leaves gracefully (stops its workers, revokes
        its lease). Its exit code (128 + SIGTERM), or None if it outlived ``timeout``."""
        node = self.nodes[name]
        node.killed = True
        with contextlib.suppress(ProcessLookupError):
            node.proc.send_signal(signal.SIGTERM)
        try:
            return node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.trial.problem(f"{self.run_id}: node {name} still running {timeout:.0f} s "
                               "after SIGTERM")
            return None

    def wait_for(self, condition: Callable[[], object], timeout: float, what: str) -> bool:
        """Poll ``condition``; on timeout the trial gets a problem and this returns False."""
        try:
            wait_until(condition, timeout, what, interval=_POLL_S)
        except WaitTimeout:
            self.trial.problem(f"{self.run_id}: timed out waiting for {what}")
            return False
        return True

    def wait_step(self, step: int, timeout: float = 120.0) -> bool:
        return self.wait_for(lambda: self.step() >= step, timeout, f"step {step}")

    def wait_done(self, timeout: float) -> bool:
        """Every node not killed has exited; True when all exited 0 and params exist."""
        deadline = time.monotonic() + timeout
        for node in self.nodes.values():
            if node.killed:
                continue
            try:
                code = node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.trial.problem(f"{self.run_id}: node {node.name} still running at the deadline")
                return False
            if code != 0:
                self.trial.problem(f"{self.run_id}: node {node.name} exited {code}")
                return False
        return self.out.exists()


@dataclass
class Trial:
    """The fixtures of one fault injection: an etcd, a folder, a process ledger."""

    cfg: ChaosConfig
    dir: Path
    etcd: EtcdServer
    ledger: ProcessLedger
    index: int = 0
    """Which trial of its fault this is (faults with variants alternate on it)."""
    jobs: list[Job] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def job(self, run_id: str = "job", **kwargs: Any) -> Job:
        job = Job(self, run_id, **kwargs)
        self.jobs.append(job)
        return job

    def problem(self, text: str) -> None:
        logger.warning("PROBLEM %s", text)
        self.problems.append(text)

    def note(self, text: str) -> None:
        logger.info("%s", text)
        self.notes.append(text)

    def check(self, ok: bool, text: str) -> None:
        """A fault-specific requirement; a failed one is a problem."""
        self.checks.append(("ok " if ok else "FAILED ") + text)
        if not ok:
            self.problem(text)
