"""Scenarios on a swarm spread over processes: form a round, lose a node, admit one.

The nodes are split over ``processes`` slices (agents/sim/swarm_slice.py), each a
process with its own event loop and etcd channels, so that the harness's
Python is not what a thousand nodes wait on. Each scenario times one event to
"every node holds the new round" and counts what it cost: etcd calls per node by
kind (sent by the nodes), retries, and etcd's own request count from its
``/metrics`` endpoint, which also sees calls our counters might miss. A run raises
:class:`HarnessBound` when the harness, not etcd, was the bottleneck (see
:meth:`agents.sim.swarm.HarnessLoad.verdict`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Iterator

from agents.sim.swarm import HarnessLoad
from agents.sim.swarm_slice import Arm, SliceResult, SliceSpec, Wanted, merge_loads, serve
from elastic_rt.rendezvous.rounds import Limits, Round

logger = logging.getLogger(__name__)
_HANDLED = re.compile(r'^grpc_server_handled_total\{.*grpc_method="(\w+)".*\} (\S+)$')
_FSYNC = ("etcd_disk_wal_fsync_duration_seconds_count ",
          "etcd_disk_wal_fsync_duration_seconds_sum ")


class HarnessBound(RuntimeError):
    """The harness (its event loop, threads or CPU) limited the figure, not etcd."""


def etcd_requests(endpoint: str) -> dict[str, float]:
    """gRPC calls etcd has answered so far, by method (Range, Txn, Put, LeaseGrant...),
    and its write-ahead log's fsyncs as ``fsync`` (count) and ``fsync_s`` (seconds)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        match = _HANDLED.match(line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0.0) + float(match.group(2))
        elif line.startswith(_FSYNC):
            name, _, value = line.partition(" ")
            counts["fsync" if name.endswith("_count") else "fsync_s"] = float(value)
    return counts


@dataclass
class Phase:
    """One event, timed until every node held the resulting round."""

    name: str
    n_nodes: int
    seconds: float
    ops: dict[str, int]
    retries: dict[str, int]
    etcd: dict[str, float]
    """etcd's answered calls in the window, by method."""
    round: Round | None = None
    began: float = 0.0
    """Monotonic time of the event."""
    milestones: dict[str, float] = field(default_factory=dict)
    """Seconds from the event to each step on the way (where the time went)."""
    fsyncs: tuple[int, float] = (0, 0.0)
    """etcd's write-ahead-log fsyncs in the window and the seconds they took: on a
    shared disk, what a raft write waits for."""
    etcd_cpu: float | None = None
    """Cores the etcd process used in the window (None: its PID was not given): near
    the box's free cores, etcd's CPU, not the harness, set the pace."""
    harness_cpu: float = 0.0
    """Cores the slice processes used together in the window."""
    etcd_cpu_wait: float = 0.0
    """Seconds etcd's threads were ready to run but waited for a CPU in the window
    (the kernel's run-queue delay, /proc/<pid>/task/*/schedstat): the direct sign
    that the box, the harness first, took the CPU etcd needed."""

    def per_node(self, exclude: tuple[str, ...] = ("watch_event", "refresh_lease")) -> float:
        """etcd calls per node for this event; keep-alives are per second, not per
        round (:attr:`SwarmReport.lease_refresh_per_s`), and watch events are pushed."""
        return sum(n for k, n in self.ops.items() if k not in exclude) / self.n_nodes

    @property
    def box_busy(self) -> float:
        """The share of the machine's cores the harness and etcd kept busy together
        (1.0: every core): near it, etcd shared the CPU with the harness."""
        return (self.harness_cpu + (self.etcd_cpu or 0.0)) / (os.cpu_count() or 1)

    @property
    def etcd_rate(self) -> float:
        return sum(self.etcd.values()) / self.seconds if self.seconds else 0.0


@dataclass
class SwarmReport:
    phases: list[Phase] = field(default_factory=list)
    load: HarnessLoad = field(default_factory=HarnessLoad)
    lease_refresh_per_s: float = 0.0
    """Keep-alives sent per second while the round stood (item: lease load at N)."""

    def check(self) -> None:
        """Raise when the harness, not etcd, set the pace of these figures."""
        verdict = self.load.verdict()
        if verdict is not None:
            raise HarnessBound(f"the harness was the bottleneck: {verdict}")


class _Slices:
    """The slice processes and their pipes; every command goes to all of them."""

    def __init__(self, specs: list[SliceSpec], start_timeout: float) -> None:
        context = multiprocessing.get_context("spawn")  # gRPC channels do not survive fork
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for spec in specs:
            mine, theirs = context.Pipe()
            proc = context.Process(target=serve, args=(theirs, spec), daemon=True,
                                   name=f"swarm-slice-{len(self.procs)}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        try:
            self.gather("ready", start_timeout)
        except BaseException:
            self.close(5.0)
            raise

    def send(self, message: object) -> None:
        for conn in self.conns:
            conn.send(message)

    def gather(self, kind: str, timeout: float) -> list[Any]:
        """Each slice's answer of ``kind``, in slice order; a slice's error is raised here."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(self.conns):
            waiting = [c for i, c in enumerate(self.conns) if i not in answers]
            ready = wait(waiting, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{len(waiting)} swarm slice(s) sent no {kind!r} within "
                                   f"{timeout:.0f} s")
            for conn in ready:
                assert isinstance(conn, Connection)
                try:
                    what, payload = conn.recv()
                except EOFError:
                    raise RuntimeError("a swarm slice process died") from None
                if what == "error":
                    raise RuntimeError(f"a swarm slice failed:\n{payload}")
                if what != kind:
                    raise RuntimeError(f"a swarm slice sent {what!r}, expected {kind!r}")
                answers[self.conns.index(conn)] = payload
        return [answers[i] for i in range(len(self.conns))]

    def close(self, timeout: float) -> list[HarnessLoad]:
        """Stop the slices (their nodes revoke their leases); their loads if they answered."""
        loads: list[HarnessLoad] = []
        try:
            self.send("close")
            loads = self.gather("closed", timeout)
        except (OSError, RuntimeError, TimeoutError) as exc:  # not to hide what ended the run
            logger.error("swarm slices did not close cleanly: %s", exc)
        finally:
            for proc in self.procs:
                proc.join(timeout)
                if proc.is_alive():  # by its PID, never by name
                    proc.kill()
                    proc.join(5)
            for conn in self.conns:
                conn.close()
        return loads


def scheduled_seconds(pid: int | None) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of all threads of ``pid``.

    From each thread's ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds, unlike the
    10 ms ticks of ``/proc/<pid>/stat``, so a phase of a tenth of a second is still
    measured); a thread that ended since is left out, so read it for a long-lived
    process (etcd). (0, 0) when ``pid`` is None or gone.
    """
    if pid is None:
        return 0.0, 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    ran = waited = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as handle:
                fields = handle.read().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return ran / 1e9, waited / 1e9


def _phase(name: str, slices: _Slices, endpoint: str, n_nodes: int, arm: Arm,
           etcd_pid: int | None) -> Phase:
    """Arm every slice, start the clock, say go, and merge what the slices saw."""
    slices.send(arm)
    slices.gather("armed", arm.timeout)
    before = etcd_requests(endpoint)
    cpu_before, wait_before = scheduled_seconds(etcd_pid)
    began = time.monotonic()
    slices.send("go")
    results: list[SliceResult] = slices.gather("result", arm.timeout + 30)
    wall = time.monotonic() - began
    cpu_after, wait_after = scheduled_seconds(etcd_pid)
    etcd_cpu = (cpu_after - cpu_before) / wall if etcd_pid else None
    after = etcd_requests(endpoint)
    missing = sum(r.missing for r in results)
    if missing:
        raise TimeoutError(f"{name}: {missing} of {n_nodes} nodes did not hold the round "
                           f"within {arm.timeout:.0f} s")
    rounds: set[Round] = set().union(*(r.rounds for r in results))
    if len(rounds) != 1:
        raise AssertionError(f"{name}: nodes disagree on the round: "
                             f"{sorted((r.number, r.token) for r in rounds)}")
    seconds = max(r.done_at for r in results) - began
    etcd = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    fsyncs = (int(etcd.pop("fsync", 0)), etcd.pop("fsync_s", 0.0))
    phase = Phase(name, n_nodes, seconds, _summed(r.ops for r in results),
                  _summed(r.retries for r in results), etcd, rounds.pop(), began,
                  etcd_cpu=etcd_cpu, fsyncs=fsyncs,
                  harness_cpu=sum(r.cpu_seconds for r in results) / wall,
                  etcd_cpu_wait=wait_after - wait_before)
    proposed = [t for r in results for t in r.proposed_at if t >= began]
    if arm.event == "start":
        phase.milestones["all joined"] = max(r.joined_at for r in results) - began
    if proposed:
        phase.milestones["round written"] = min(proposed) - began
    return phase


def _summed(counts: Iterator[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return dict(total)


def run_swarm(endpoint: str, n_nodes: int, *, processes: int = 2, events: bool = True,
              clients: int = 32, timeout: float = 60.0, settle: float = 3.0,
              etcd_pid: int | None = None, **node_kwargs: Any) -> SwarmReport:
    """Form a round of ``n_nodes`` over ``processes`` slices; with ``events``, then
    evict one node and admit one.

    ``clients`` is each slice's channels; ``etcd_pid``, when given, has each
    phase report etcd's CPU. The eviction is what an agent does
    when a peer's liveness socket refuses (it revokes the peer's lease), so the time
    measured is the protocol's, not a TTL.
    """
    run_id = f"swarm-{uuid.uuid4().hex[:8]}"
    limits = Limits(min_nodes=max(1, n_nodes - 1), max_nodes=n_nodes, last_call=60.0)
    names = [f"node-{i:04d}" for i in range(n_nodes)]
    processes = max(1, min(processes, n_nodes))
    specs = [SliceSpec(i, endpoint, run_id, tuple(names[i::processes]), limits, clients,
                       **node_kwargs) for i in range(processes)]
    report = SwarmReport()
    slices = _Slices(specs, start_timeout=timeout)
    try:
        formed = _phase("form", slices, endpoint, n_nodes,
                        Arm("start", Wanted(), timeout), etcd_pid)
        report.phases.append(formed)
        slices.send(("keepalives", settle))
        report.lease_refresh_per_s = sum(slices.gather("keepalives", settle + timeout)) / settle
        if events:
            assert formed.round is not None
            victim = names[n_nodes // 2]
            report.phases.append(_phase(
                "lose 1", slices, endpoint, n_nodes - 1,
                Arm("stop", Wanted(after=formed.round.number, without=victim), timeout,
                    node_id=victim), etcd_pid))
            report.phases.append(_phase(
                "grow 1", slices, endpoint, n_nodes,
                Arm("add", Wanted(including="node-new"), timeout, node_id="node-new"),
                etcd_pid))
    finally:
        loads = slices.close(timeout)
    if not loads:
        raise RuntimeError("the swarm slices did not report their load, so whether the "
                           "harness set the pace cannot be judged")
    report.load = merge_loads(loads)
    busiest = max(report.phases, key=lambda phase: phase.box_busy)
    report.load.box_busy, report.load.box_busy_phase = busiest.box_busy, busiest.name
    return report
