"""Recovery after a node fault: elastic-rt (in-process, restart mode) beside torchrun.

Three nodes on loopback, one gloo worker each, CPU. Once the job has completed
``--kill-step`` steps, node ``c`` is hit by the case's fault. Measured per trial:

- **recovery**: seconds from the fault (``time.time()`` taken right before the
  first ``os.killpg``) to the first step a survivor completes *after recovery*:
  in-process, a ``step.completed`` event of a later round than the fault's; with
  restarts (restart mode, torchrun), a progress row from a worker process that did
  not exist at the fault. (A step a survivor finishes just after the fault in the
  old round, its all-reduce already done, is not a recovery.)
- **steps lost**: the last step completed before recovery (any node, old round or
  old processes) minus the step the survivors resume from (their first step after
  recovery, minus one). Restart mode and torchrun resume from the last
  ``torch.save`` checkpoint (``--ckpt-every``); in-process from a survivor's memory.

Cases (all kill the same node ``c``, never torchrun's store host ``a``, see below):

=================  ==========================================================
inproc-kill        elastic-rt in-process (``elastic_train.py``); SIGKILL to every
                   process group of node c (agent and worker)
inproc-hang        same, SIGSTOP instead (a hung node): the agents' heartbeats evict
                   it and the round's notice frees the survivors; SIGCONT afterwards
inproc-worker      same, SIGKILL of node c's worker process group only
restart-kill       elastic-rt restart mode: ``torchrun_ddp.py`` under
                   ``elastic-rt launch``; node SIGKILL
torchrun-default   ``torchrun --rdzv-backend=c10d --nnodes 2:3`` with its
                   rendezvous defaults; node SIGKILL
torchrun-fast      the same with the fastest settings that still work reliably
                   (``--torchrun-fast-conf``); node SIGKILL
torchrun-etcd-v3   stock torchrun with elastic-rt's ``--rdzv-backend etcd-v3`` on the
                   bench's etcd, the same fast settings; node SIGKILL
inproc-join        no fault: only a and b start, and node c is started at
                   ``--kill-step``; the job grows to 3 (elastic-rt in-process)
restart-join       the same in restart mode (``torchrun_ddp.py``): every worker
                   restarts from the last checkpoint, as torchrun does on a join
inproc-fence       node c is SIGSTOPped until its lease expires and the others
                   train on without it, then SIGCONTed: it finds itself fenced
                   and comes back (the fault's time is the SIGCONT)
inproc-worker-min  ``--nnodes 3:3``: the job is at its minimum node count, so
                   node c cannot step out; SIGKILL of its worker process group
inproc-spare       inproc-kill with a fourth node ``d`` started beyond ``--nnodes``
                   MAX: it waits as a hot spare and the round that drops c admits it
                   (the job never shrinks)
inproc-fsdp-kill   inproc-kill with the state sharded over the three ranks (FSDP2,
                   ``--max-shard 3``, peer copies every step): ``--state-mb`` is then the
                   job's whole state, a third of it per rank, and the survivors restore
                   the lost third from the copies in their host memory
inproc-preempt     no fault: node c's agent alone gets SIGTERM (a preemption with a grace
                   period, as Kubernetes and Slurm send it); c leaves at its workers'
                   next step boundary and the survivors re-form without it
inproc-fsdp-       inproc-preempt under FSDP (``--max-shard 3``): c's third of the state
preempt            goes to a peer copy of the step it leaves after
=================  ==========================================================

For the preempt cases "recovery" is the time from the SIGTERM to the survivors' first step
in the round without c, which includes the step c finishes first (the notice lands in
one; the boundary comes after the next); the figure that matters is the survivors' **longest
pause** beyond a step: their gap between the step c left after and their next one.
For the join cases and inproc-fence "recovery" is the time from starting (or
continuing) node c to the first step at world size 3, and the figure that matters
is the survivors' **longest pause**:
the longest gap between two steps completed anywhere from c's start until three
steps at world size 3 (in-process, a and b train on while c starts). On one machine that
window also holds c's start and model build on the members' cores, which on a cluster
run on c's own; so in-process joins also show the members' gap at the admission: their
longest gap from their last step before the round that admits c to three steps after.

torchrun's c10d rendezvous store lives in the agent of the node that hosts it
(``is_host=true``, node a here); killing that node ends the job for everyone, so
torchrun can only survive losing another node, and node c is the victim in every
case. torchrun needs ``--max-restarts`` > 0 to survive anything (its default is 0):
the survivors' workers fail when a peer dies and count as a restart. 3 is used
(``--torchrun-max-restarts``). On this machine torchrun's first restarted workers
often fail gloo's ``connectFullMesh`` (connection refused) and need 2-3 restarts
before the survivors train again; with short rendezvous timeouts the job often
never recovers (a trial then reports a timeout; 10 restarts did not help).

elastic-rt's workers run with a 10-minute collective timeout
(``--collective-timeout``, ``ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC``), the way NCCL behaves:
a collective blocked on a dead or hung peer is never freed by a timeout within the
trial, only by elastic-rt's own failure handling (a failed socket, or the notice of
the round that drops the peer). Recovery times are reported as median and p90 over
the trials.

Both scripts build an MLP on 16 samples per rank (48 per step) and sleep ``--step-time``
per step (simulated compute). By default it is the 2,000-parameter
Linear(64, 64)-Tanh-Linear(64, 1), which says nothing about large models: ``--state-mb``
sizes it to that much replica state instead (12 bytes a parameter: weights and AdamW's
two moments; 50, 400 and 1200 are what users have). In-process cases then build it of
Linear(2048, 2048) layers (24 at 1.2 GB: 100.7M parameters, the model of issue 22), as
large models are built; ``--shape wide`` puts it all in one Linear(1024, H) instead, the
bench's model before 2026-12-07, whose single 400 MB tensor makes every AdamW update map
its temporaries afresh (glibc maps blocks over 32 MiB and unmaps them at their free) and
so fault 800 MB in a step (figures in the docs dated before then were taken with it). At
1.2 GB the layers' step here is about as long (2.7-3.3 s at 0.6 CPU a node), and more of it
is forward and backward. Then each trial also reports the
survivors' normal step (the median gap between their steps before the fault), recovery
and pause *beyond* it, and the bytes of state the survivors' restore moved (the
``bytes_moved`` of their ``state.restored`` events; "-" where the restore does not say).
On 2 cores a step after a node loss is faster than one before (two workers share the
cores, not three), and one after a join slower, so the survivors' step after recovery is
shown too, and recovery and the longest pause beyond it: on a cluster each node brings
its own cores and the step does not change with the world size, so for a join the step
after is the fair baseline. In-process trials also show the most any survivor's RSS rose
above its start during its restore (``rss_growth_bytes``: the kernel's peak RSS, reset as
the restore begins). Join trials also show the newcomer's stream: the bytes it received over
the stream's own time, from its start at the end of the restore to its last byte (``stream_ms``
of ``state.landed``; where a run does not report it, to the state landing, the step it sat
out done), against one TCP connection over loopback measured at the start (best of three),
and against the same measured while the members train, just before c starts: on two cores
the stream shares them with two training workers, which a cluster's nodes do not.
``--cores-per-node`` (root) simulates those nodes: each node's workers run in a cgroup of
that many CPUs (in 100 ms periods), three at 0.6 fitting the two cores, so no node's step
takes another's CPU and a step keeps its time when the job grows; the agents, light
processes that a cluster's node has cores for, run outside. The loopback baselines are then
measured between two processes each held to one node's share (a sender and a receiver).
The join's stream runs beside the members' training, which takes their share too: the
baseline measured while they train is the one it can reach.

Run:  python scripts/bench/recovery.py                   # all cases (~6 min)
      python scripts/bench/recovery.py --cases inproc-kill inproc-join --state-mb 1200
      python scripts/bench/recovery.py --quick           # 1 repeat, no torchrun-default
      python scripts/bench/recovery.py --cases inproc-kill torchrun-fast --repeats 5
      python scripts/bench/recovery.py --cases inproc-join --state-mb 1200 --kill-step 8 \
          --cores-per-node 0.6 --start-timeout 300   # a join at 1.2 GB, nodes of 0.6 CPU
      python scripts/bench/recovery.py --cases inproc-fsdp-kill --state-mb 1200 \
          --kill-step 8 --ckpt-every 5 --start-timeout 300   # FSDP at 1.2 GB: ~6 s a step
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from _common import JsonLines, fmt, interruptible, loopback_rate, median, p90, table

from elastic_rt.config import COLLECTIVE_TIMEOUT_ENV

from elastic_rt.etcd_server import EtcdServer, free_port
from elastic_rt.events import read_events
from elastic_rt.harness import PYTHON, REPO, ProcessLedger, child_env, wait_until
from elastic_rt.harness.cpu_limit import cgroup_cpu_reason, cpu_quota
from elastic_rt.rendezvous.rounds import SPARE

ELASTIC_SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
TORCHRUN_SCRIPT = str(REPO / "scripts" / "examples" / "torchrun_ddp.py")
NODES = ("a", "b", "c")
VICTIM = "c"
SPARE_NODE = "d"
FAST_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,close_timeout=1"
FAST_MONITOR = 0.1
STATE_BYTES_PER_PARAM = 12  # float32 weights and AdamW's two moments
LAYER = 2048  # --state-mb's model: Linear(2048, 2048) layers (4.2M parameters each)
WIDE_INPUT = 1024  # --shape wide: Linear(1024, H)-Tanh-Linear(H, 1), one layer of them all
NODE_PERIOD_US = 100_000  # a node's quota period (--cores-per-node): see cpu_quota
_POLL_S = 0.02  # how often waits look at the progress files (recovery times are in 0.1 s)
T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    name: str
    launcher: str
    """"elastic" or "torchrun"."""
    in_process: bool
    fault: str
    """"node-kill", "node-hang", "worker-kill", "join", "fence" or "preempt"."""
    target: str
    rdzv_conf: str = ""
    rdzv_backend: str = "c10d"
    """torchrun's ``--rdzv-backend``: torch's ``c10d`` or elastic-rt's ``etcd-v3``."""
    min_nodes: int = 2
    """elastic-rt ``--nnodes MIN:3``."""
    script_flags: tuple[str, ...] = ()
    """More flags for the training script."""
    spare: bool = False
    """A fourth node, beyond ``--nnodes`` MAX, waits as a spare and replaces the victim."""


def cases(args: argparse.Namespace) -> dict[str, Case]:
    ttl = args.lease_ttl
    listed = [
        Case("inproc-kill", "elastic", True, "node-kill", "median <= 0.3 s, p90 <= 0.5 s, 0 lost"),
        Case("inproc-hang", "elastic", True, "node-hang",
             f"median <= 1.0 s (lease TTL {ttl} s), 0 lost"),
        Case("inproc-worker", "elastic", True, "worker-kill", "<= 1.5 s"),
        Case("restart-kill", "elastic", False, "node-kill", "<= 6 s"),
        Case("torchrun-default", "torchrun", False, "node-kill", "-"),
        Case("torchrun-fast", "torchrun", False, "node-kill", "-",
             rdzv_conf=args.torchrun_fast_conf),
        Case("torchrun-etcd-v3", "torchrun", False, "node-kill", "-",
             rdzv_conf=args.torchrun_fast_conf, rdzv_backend="etcd-v3"),
        Case("inproc-join", "elastic", True, "join", "pause <= 1.5 s"),
        Case("restart-join", "elastic", False, "join", "-"),
        Case("inproc-fence", "elastic", True, "fence", "pause <= 1.0 s"),
        Case("inproc-worker-min", "elastic", True, "worker-kill", "<= 1.5 s", min_nodes=3),
        Case("inproc-spare", "elastic", True, "node-kill", "pause <= 0.3 s beyond a step",
             spare=True),
        Case("inproc-fsdp-kill", "elastic", True, "node-kill",
             "<= 1.5 s beyond a step, <= 1 redone (peer copies)",
             script_flags=("--max-shard", str(len(NODES)))),
        Case("inproc-preempt", "elastic", True, "preempt",
             "pause <= 0.3 s beyond a step (one re-form), 0 redone"),
        Case("inproc-fsdp-preempt", "elastic", True, "preempt", "0 redone (peer copies)",
             script_flags=("--max-shard", str(len(NODES)))),
    ]
    return {c.name: c for c in listed}


@dataclass(frozen=True)
class Trial:
    recovery_s: float | None
    steps_lost: int | None
    last_before: int | None
    resumed_from: int | None
    victim_rank: int | None
    error: str = ""
    pause_s: float | None = None
    """Longest gap between two completed steps from the fault to ``--steps-after`` steps
    after recovery."""
    reform_ms: int | None = None
    """In-process: the survivors' longest ``groups.reformed`` in the round they resumed in."""
    step_s: float | None = None
    """A survivor's median step time before the fault (what no recovery can beat)."""
    bytes_moved: int | None = None
    """In-process: the bytes the survivors' restores moved in the round they resumed in."""
    step_after_s: float | None = None
    """A survivor's median step time after recovery (fewer workers share the cores then)."""
    rss_growth: int | None = None
    """In-process: the most a survivor's RSS rose above its start during its restore."""
    ready_s: float | None = None
    """In-process: from the survivors' last step in the old round to the end of their
    slowest restore in the new one: the pause without the step that follows it (which on
    these shared cores varies more than the re-form itself)."""
    stream_rate: float | None = None
    """Join: the bytes the newcomer received over the time from the end of its restore to
    its state landing (the step it lands in done): a floor of the stream's speed."""
    admission_gap_s: float | None = None
    """Join: the members' longest gap between two of their steps from their last step before
    the round that admits c to ``--steps-after`` steps after it: the pause the admission
    itself costs, where the longest pause also holds c's start and build on the members'
    cores."""
    busy_loopback: float | None = None
    """In-process join: one loopback TCP connection's rate (best of three) measured while
    the members train, just before c starts: what the machine's loopback gives a stream
    that shares its cores with two training workers, as the newcomer's stream does here."""


@dataclass(frozen=True)
class Row:
    """One completed step of one worker, from either script's output."""

    time: float
    step: int
    rank: int
    world_size: int
    node: str | None
    round: int | None
    pid: int | None


def _rows(case: Case, tail: JsonLines) -> list[Row]:
    new = tail.poll()
    if case.in_process:
        return [Row(e["timestamp_ms"] / 1000, e["step"], e["rank"], e["metadata"]["world_size"],
                    e["node"], e["round"], None)
                for e in new if e.get("name") == "step.completed"]
    return [Row(r["time"], r["step"], r["rank"], r["world_size"], None, None, r["pid"])
            for r in new]


class Job:
    """One trial's three nodes."""

    def __init__(self, case: Case, args: argparse.Namespace, procs: ProcessLedger,
                 etcd: EtcdServer | None, work: Path) -> None:
        self.case, self.args, self.procs, self.etcd, self.work = case, args, procs, etcd, work
        self.events = work / "events.jsonl"
        self.output = self.events if case.in_process else work / "progress.jsonl"
        self.tail = JsonLines(self.output)
        self.rows: list[Row] = []
        self.nodes: dict[str, int] = {}
        self.run_id = f"bench-{case.name}-{uuid.uuid4().hex[:6]}"
        self.store_port = free_port()
        self.quotas = contextlib.ExitStack()
        """Each node's CPU quota (``--cores-per-node``), lifted by :meth:`release`."""
        self.groups: dict[str, list[int]] = {}
        self._confining = threading.Event()
        self._confiner = threading.Thread(target=self._confine, name="confine", daemon=True)

    def start(self) -> None:
        for node in NODES:
            if node != VICTIM or self.case.fault != "join":
                self._start_node(node)

    def _start_node(self, node: str) -> float:
        stamp = time.time()
        proc = self.procs.start(self._command(node), env=self._env(), log=self.work / f"{node}.log")
        self.nodes[node] = proc.pid  # first: the confiner reads it for every group
        if self.args.cores_per_node:
            self.groups[node] = self.quotas.enter_context(
                cpu_quota(self.args.cores_per_node, period_us=NODE_PERIOD_US))
            if not self._confiner.is_alive():
                self._confiner.start()
        return stamp

    def _confine(self) -> None:
        """Move each node's workers into its quota as they start (within 50 ms; they import
        torch first). The agent stays out: on a cluster it is a light process on a node of
        many cores, and held in the same 0.6 CPU as a 1.2 GB worker, agents went silent
        past their heartbeat and lease."""
        while not self._confining.wait(0.05):
            for node, group in list(self.groups.items()):
                for child in self.procs.tree(self.nodes[node])[1:]:
                    if child.pid not in group:
                        with contextlib.suppress(OSError):  # gone meanwhile
                            group.append(child.pid)

    def release(self) -> None:
        """Lift the nodes' CPU quotas (after their processes are stopped)."""
        self._confining.set()
        if self._confiner.is_alive():
            self._confiner.join()
        self.quotas.close()

    def _script(self) -> list[str]:
        a = self.args
        common = ["--steps", "100000", "--step-time", str(a.step_time)]
        params = int(a.state_mb * 1e6 / STATE_BYTES_PER_PARAM)
        if self.case.in_process:
            size = self._size(params) if a.state_mb else ["--width", "64"]
            return [ELASTIC_SCRIPT, *common, *size, *self.case.script_flags, "--global-batch", "48",
                    "--checkpoint", str(self.work / "ckpt"), "--every", str(a.ckpt_every)]
        width = int(params ** 0.5) if a.state_mb else 64  # Linear(w, w)-Tanh-Linear(w, 1)
        return [TORCHRUN_SCRIPT, *common, "--width", str(width),
                "--ckpt", str(self.work / "ckpt.pt"),
                "--ckpt-every", str(a.ckpt_every), "--progress", str(self.output)]

    def _size(self, params: int) -> list[str]:
        """The example's options for a model of about ``params`` parameters."""
        if self.args.shape == "wide":
            return ["--width", str(WIDE_INPUT), "--hidden", str(max(1, params // WIDE_INPUT))]
        depth = max(1, round(params / (LAYER * (LAYER + 1))))
        return ["--width", str(LAYER), "--hidden", str(LAYER), "--depth", str(depth)]

    def _command(self, node: str) -> list[str]:
        if self.case.launcher == "elastic":
            assert self.etcd is not None
            return [PYTHON, "-m", "elastic_rt.cli", "launch", "--nnodes",
                    f"{self.case.min_nodes}:3",
                    "--nproc-per-node", "1", "--rdzv-endpoint", f"etcd://{self.etcd.endpoint}",
                    "--run-id", self.run_id, "--node-id", node, "--events-file", str(self.events),
                    "--lease-ttl", str(self.args.lease_ttl), *self._script()]
        if self.case.rdzv_backend == "etcd-v3":
            assert self.etcd is not None
            conf, endpoint = [], self.etcd.endpoint  # no store host: the state is in etcd
        else:
            conf = [f"is_host={'true' if node == NODES[0] else 'false'}"]
            endpoint = f"127.0.0.1:{self.store_port}"
        if self.case.rdzv_conf:
            conf.append(self.case.rdzv_conf)
        monitor = self.args.torchrun_fast_monitor if self.case.rdzv_conf else 0.1
        return [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-backend", self.case.rdzv_backend, "--rdzv-endpoint", endpoint,
                "--rdzv-id", self.run_id, "--rdzv-conf", ",".join(conf),
                "--max-restarts", str(self.args.torchrun_max_restarts),
                "--monitor-interval", str(monitor), "--local-addr", "127.0.0.1", *self._script()]

    def _env(self) -> dict[str, str]:
        # elastic-rt's defaults throughout, but for the collective timeout (see the docstring).
        threads = {"OMP_NUM_THREADS": str(self.args.worker_threads)} \
            if self.args.worker_threads else {}
        return child_env(**{COLLECTIVE_TIMEOUT_ENV: str(self.args.collective_timeout)},
                         **threads)

    def poll(self) -> list[Row]:
        new = _rows(self.case, self.tail)
        self.rows.extend(new)
        return self.rows

    def _check_alive(self) -> None:
        for node, pid in self.nodes.items():
            proc = next(p for p in self.procs.procs if p.pid == pid)
            if proc.poll() is not None and not (node == VICTIM and self._faulted):
                log = (self.work / f"{node}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"node {node} exited with {proc.returncode}:\n{log}")

    def _until(self, condition: Callable[[], T | None], timeout: float, what: str) -> T:
        """:func:`wait_until`, but a node that exited unexpectedly fails the wait at once."""

        def alive_and() -> T | None:
            self._check_alive()
            return condition()

        return wait_until(alive_and, timeout, what, interval=_POLL_S)

    _faulted = False

    def run_trial(self) -> Trial:
        a = self.args
        self.start()
        self._until(lambda: max((r.step for r in self.poll()), default=0) >= a.kill_step,
                    a.start_timeout, f"step {a.kill_step}")
        if self.case.spare:  # started once the round is full: it can only be a spare
            self._start_node(SPARE_NODE)
            self._until(lambda: any(e.name == "node.waiting" and e.node == SPARE_NODE
                                    and e.metadata.get("reason") == SPARE
                                    for e in read_events(str(self.events))),
                        a.start_timeout, "the spare registered and waiting")
        victim_tree = self.procs.tree(self.nodes[VICTIM]) if VICTIM in self.nodes else []
        old_pids = {p.pid for pid in self.nodes.values() for p in self.procs.tree(pid)}
        fault_round = max((r.round or 0) for r in self.poll())
        busy_loopback = (_loopback(a.cores_per_node)
                         if self.case.in_process and self.case.fault == "join" else None)
        stamp = self._fault(victim_tree, fault_round)
        self._faulted = True

        def recovered(r: Row) -> bool:
            if r.time <= stamp:
                return False
            if self.case.fault == "join":
                return r.world_size == len(NODES)
            if self.case.fault == "fence":  # c's old worker may log a step as it continues
                return r.world_size == len(NODES) and (r.round or 0) > fault_round
            if self.case.in_process:
                return r.node != VICTIM and (r.round or 0) > fault_round
            return r.pid not in old_pids

        first = self._until(lambda: next((r for r in self.poll() if recovered(r)), None),
                            a.recover_timeout, "the survivors' next step")
        # The job must go on after recovery (a false eviction would show here).
        self._until(lambda: any(recovered(r) and r.step >= first.step + a.steps_after
                                for r in self.poll()),
                    a.recover_timeout, f"{a.steps_after} more steps after recovery")
        if self.case.fault == "node-hang":
            self.procs.signal_tree(self.nodes[VICTIM], signal.SIGCONT)

        def old(r: Row) -> bool:
            return (r.round or 0) <= fault_round if self.case.in_process else r.pid in old_pids

        before = [r for r in self.rows if old(r) and not recovered(r)]
        last_before = max(r.step for r in before)
        victim_rank = next((r.rank for r in before if self._is_victim(r, victim_tree)), None)
        end = min(r.time for r in self.rows
                  if recovered(r) and r.step >= first.step + a.steps_after)
        times = sorted({r.time for r in self.rows if stamp - 1 <= r.time <= end} | {stamp})
        pause = max((b - a for a, b in zip(times, times[1:])), default=None)
        after = [r for r in self.rows if recovered(r) and r.node != VICTIM and r.time <= end]
        return Trial(recovery_s=first.time - stamp,
                     steps_lost=max(0, last_before - (first.step - 1)), last_before=last_before,
                     resumed_from=first.step - 1, victim_rank=victim_rank, pause_s=pause,
                     reform_ms=self._reform_ms(first.round), step_s=_step_time(before),
                     bytes_moved=self._bytes_moved(first.round), step_after_s=_step_time(after),
                     rss_growth=self._rss_growth(first.round),
                     ready_s=self._ready_s(first.round, before),
                     stream_rate=self._stream_rate(first.round),
                     admission_gap_s=self._admission_gap(first, end),
                     busy_loopback=busy_loopback)

    def _admission_gap(self, first: Row, end: float) -> float | None:
        if not self.case.in_process or self.case.fault != "join":
            return None
        members = [r for r in self.rows if r.node != VICTIM and r.time <= end]
        older = [r.time for r in members if (r.round or 0) < (first.round or 0)]
        if not older:
            return None
        times = sorted({r.time for r in members if r.time >= max(older)})
        return max((b - a for a, b in zip(times, times[1:])), default=None)

    def _stream_rate(self, round_: int | None) -> float | None:
        if not self.case.in_process or self.case.fault != "join":
            return None
        landed = [e.metadata for e in read_events(str(self.events))
                  if e.name == "state.landed" and e.round == round_ and e.node == VICTIM]
        rates = [m["bytes_moved"] / (m.get("stream_ms") or m["duration_ms"]) * 1000
                 for m in landed
                 if isinstance(m.get("bytes_moved"), int) and m.get("duration_ms")]
        return min(rates, default=None)

    def _ready_s(self, round_: int | None, before: list[Row]) -> float | None:
        if not self.case.in_process or self.case.fault == "join":
            return None
        ends = [e.timestamp_ms / 1000 for e in read_events(str(self.events))
                if e.name == "state.restored" and e.round == round_ and e.node != VICTIM]
        last = [r.time for r in before if r.node != VICTIM]
        return max(ends) - max(last) if ends and last else None

    def _rss_growth(self, round_: int | None) -> int | None:
        if not self.case.in_process:
            return None
        grown = [e.metadata.get("rss_growth_bytes") for e in read_events(str(self.events))
                 if e.name == "state.restored" and e.round == round_ and e.node != VICTIM]
        return max((g for g in grown if isinstance(g, int)), default=None)

    def _bytes_moved(self, round_: int | None) -> int | None:
        if not self.case.in_process:
            return None
        moved = [e.metadata.get("bytes_moved") for e in read_events(str(self.events))
                 if e.name == "state.restored" and e.round == round_ and e.node != VICTIM]
        counts = [m for m in moved if isinstance(m, int)]
        return sum(counts) if counts and len(counts) == len(moved) else None

    def _reform_ms(self, round_: int | None) -> int | None:
        if not self.case.in_process:
            return None
        spans = [e.metadata.get("duration_ms", 0) for e in read_events(str(self.events))
                 if e.name == "groups.reformed" and e.round == round_ and e.node != VICTIM]
        return max(spans, default=None)

    def _is_victim(self, r: Row, victim_tree: list) -> bool:
        if self.case.in_process:
            return r.node == VICTIM
        return r.pid in {p.pid for p in victim_tree}

    def _fault(self, victim_tree: list, fault_round: int) -> float:
        if self.case.fault == "join":
            return self._start_node(VICTIM)
        root = self.nodes[VICTIM]
        if self.case.fault == "fence":
            return self._fence(root, fault_round)
        if self.case.fault == "node-kill":
            return self.procs.signal_tree(root, signal.SIGKILL)
        if self.case.fault == "preempt":  # the agent alone, as Kubernetes signals PID 1
            stamp = time.time()
            os.kill(root, signal.SIGTERM)
            return stamp
        if self.case.fault == "node-hang":
            return self.procs.signal_tree(root, signal.SIGSTOP)
        workers = [p for p in victim_tree if p.pid != root]
        if not workers:
            raise RuntimeError("node c has no worker process")
        return self.procs.signal_tree(workers[0].pid, signal.SIGKILL)

    def _fence(self, root: int, fault_round: int) -> float:
        """Stop node c until the others train on without it (its lease is gone), then
        continue it; returns when it was continued."""
        self._faulted = True
        self.procs.signal_tree(root, signal.SIGSTOP)
        try:
            self._until(lambda: [r for r in self.poll() if (r.round or 0) > fault_round
                                 and r.node != VICTIM and r.world_size < len(NODES)][2:] or None,
                        self.args.recover_timeout, "3 steps without node c")
        finally:
            stamp = self.procs.signal_tree(root, signal.SIGCONT)
        return stamp


def _step_time(rows: list[Row]) -> float | None:
    """The median gap between one rank's consecutive steps (the first rank's, before the fault)."""
    if not rows:
        return None
    rank = rows[0].rank
    times = sorted(r.time for r in rows if r.rank == rank)
    return median([b - a for a, b in zip(times, times[1:])])


def _loopback(cores: float, tries: int = 3) -> float:
    """One loopback TCP connection's rate (:func:`loopback_rate`, the best of ``tries``).
    With ``cores`` (per node), between two processes each held to one node's share, as a
    stream between two nodes runs (in one process held to two nodes' share, as this bench
    measured until 2026-12-07, the receiving side could take more than its node has)."""
    if not cores:
        return loopback_rate(tries=tries)
    return max(_loopback_between_nodes(cores) for _ in range(tries))


def _loopback_between_nodes(cores: float) -> float:
    def start(code: str, share: list[int]) -> subprocess.Popen[str]:
        proc = subprocess.Popen([PYTHON, "-c", f"from _common import *; {code}"],
                                cwd=Path(__file__).parent, env=child_env(), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        share.append(proc.pid)  # before it sends or receives: it imports first
        started.append(proc)
        return proc

    started: list[subprocess.Popen[str]] = []
    with cpu_quota(cores, period_us=NODE_PERIOD_US) as receiving, \
            cpu_quota(cores, period_us=NODE_PERIOD_US) as sending:
        try:
            receiver = start("receive_once()", receiving)
            assert receiver.stdout is not None
            port = int(receiver.stdout.readline())
            sender = start(f"send_once({port})", sending)
            sender.communicate("go\n", timeout=300)  # in its share now: it may send
            out, _ = receiver.communicate(timeout=300)
        finally:
            for proc in started:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    codes = [proc.returncode for proc in started]
    if any(codes):
        raise RuntimeError(f"the loopback measurement exited with {codes} (receiver, sender)")
    return float(out)


def _mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e6


def _beyond(value: float | None, step: float | None) -> str:
    return "-" if value is None or step is None else fmt(value - step)


def run_case(case: Case, args: argparse.Namespace, etcd: EtcdServer | None, root: Path,
             repeats: int) -> list[Trial]:
    trials = []
    for i in range(repeats):
        work = root / f"{case.name}-{i}"
        work.mkdir(parents=True)
        procs = ProcessLedger()
        began = time.monotonic()
        job = Job(case, args, procs, etcd, work)
        try:
            trial = job.run_trial()
        except (TimeoutError, RuntimeError) as exc:
            trial = Trial(None, None, None, None, None, error=str(exc).splitlines()[0])
        finally:
            procs.close()
            job.release()
        trials.append(trial)
        stream = (f", stream {fmt(_mb(trial.stream_rate), '.0f')} MB/s (loopback beside "
                  f"training {fmt(_mb(trial.busy_loopback), '.0f')} MB/s), members' gap at the "
                  f"admission {fmt(trial.admission_gap_s)} s"
                  if trial.stream_rate is not None else "")
        print(f"  {case.name} #{i + 1}: recovery {fmt(trial.recovery_s)} s, steps lost "
              f"{fmt(trial.steps_lost, 'd')}, longest pause {fmt(trial.pause_s)} s, "
              f"groups.reformed {fmt(trial.reform_ms, 'd')} ms, normal step "
              f"{fmt(trial.step_s)} s (recovery {_beyond(trial.recovery_s, trial.step_s)} s "
              f"beyond it; step after it {fmt(trial.step_after_s)} s), bytes moved "
              f"{fmt(trial.bytes_moved, 'd')}, restore's peak extra RSS "
              f"{fmt(_mb(trial.rss_growth), '.0f')} MB, last step to restored "
              f"{fmt(trial.ready_s)} s{stream} "
              f"(last {trial.last_before}, resumed from "
              f"{trial.resumed_from}), victim rank {trial.victim_rank}, trial took "
              f"{time.monotonic() - began:.0f} s{'  ERROR: ' + trial.error if trial.error else ''}"
              f"  [{work}]", flush=True)
    return trials


def report(results: dict[str, list[Trial]], chosen: dict[str, Case],
           loopback: float | None) -> str:
    med = {n: median([t.recovery_s for t in ts if t.recovery_s is not None])
           for n, ts in results.items()}
    default, fast = med.get("torchrun-default"), med.get("torchrun-fast")

    def ratio(base: float | None, value: float | None) -> str:
        return "-" if base is None or not value else f"{base / value:.1f}x"

    rows = []
    for name, trials in results.items():
        ok = [t for t in trials if t.recovery_s is not None]
        times = [t.recovery_s for t in ok if t.recovery_s is not None]
        lost = median([t.steps_lost for t in ok])
        pauses = [t.pause_s for t in ok if t.pause_s is not None]
        reforms = [t.reform_ms for t in ok if t.reform_ms is not None]
        step = median([t.step_s for t in ok if t.step_s is not None])
        moved = median([t.bytes_moved for t in ok if t.bytes_moved is not None])
        after = median([t.step_after_s for t in ok if t.step_after_s is not None])
        grown = max((t.rss_growth for t in ok if t.rss_growth is not None), default=None)
        ready = [t.ready_s for t in ok if t.ready_s is not None]
        stream = median([t.stream_rate for t in ok if t.stream_rate is not None])
        admission = median([t.admission_gap_s for t in ok if t.admission_gap_s is not None])
        beside = median([t.stream_rate / t.busy_loopback for t in ok
                         if t.stream_rate is not None and t.busy_loopback])
        rows.append([
            name, f"{len(ok)}/{len(trials)}", fmt(med[name]), fmt(p90(times)),
            f"{fmt(min(times, default=None))}-{fmt(max(times, default=None))}",
            fmt(lost, ".0f"), fmt(median(pauses)), fmt(p90(pauses)),
            f"{fmt(median(reforms), '.0f')} / {fmt(p90(reforms), '.0f')}",
            fmt(step), _beyond(med[name], step), _beyond(median(pauses), step),
            fmt(after), _beyond(med[name], after), _beyond(median(pauses), after),
            fmt(moved, ".0f"), fmt(_mb(grown), ".0f"), f"{fmt(median(ready))} / {fmt(p90(ready))}",
            fmt(_mb(stream), ".0f"),
            "-" if stream is None or not loopback else f"{stream / loopback:.2f}",
            fmt(beside), fmt(admission), _beyond(admission, step), _beyond(admission, after),
            ratio(default, med[name]), ratio(fast, med[name]), chosen[name].target,
        ])  # fmt: skip
    return table(["case", "ok", "recovery s (median)", "p90", "min-max", "steps lost (median)",
                  "longest pause s (median)", "p90", "groups.reformed ms (median / p90)",
                  "normal step s", "recovery beyond a step", "pause beyond a step",
                  "step after s", "recovery beyond the step after", "pause beyond the step after",
                  "bytes moved (median)",
                  "restore's peak extra RSS MB (max)",
                  "last step to restored s (median / p90)",
                  "join: newcomer's stream MB/s (median)", "stream / loopback TCP",
                  "stream / loopback beside training (median)",
                  "join: members' gap at the admission s (median)", "gap beyond a step",
                  "gap beyond the step after",
                  "torchrun-default / this",
                  "torchrun-fast / this", "target"], rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=None,
                   help="cases to run (default: all; --quick drops torchrun-default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slow-repeats", type=int, default=1,
                   help="repeats of torchrun-default (about a minute each)")
    p.add_argument("--quick", action="store_true", help="1 repeat each, no torchrun-default")
    p.add_argument("--kill-step", type=int, default=35,
                   help="fault once this step is done (35: mid-way between checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--state-mb", type=float, default=0,
                   help="size the model to this much replica state (MB; 0: the 2,000-parameter "
                        "model)")
    p.add_argument("--shape", choices=["layers", "wide"], default="layers",
                   help="of the --state-mb model (in-process cases): Linear(2048, 2048) layers, "
                        "as large models are built, or wide: one Linear(1024, H) of them all")
    p.add_argument("--step-time", type=float, default=0.05, help="simulated compute per step (s)")
    p.add_argument("--lease-ttl", type=int, default=3, help="elastic-rt --lease-ttl (s)")
    p.add_argument("--collective-timeout", type=float, default=600,
                   help="elastic-rt workers' collective timeout (s); 600 behaves like NCCL")
    p.add_argument("--torchrun-fast-conf", default=FAST_CONF, help="--rdzv-conf of torchrun-fast")
    p.add_argument("--torchrun-fast-monitor", type=float, default=FAST_MONITOR,
                   help="--monitor-interval of torchrun-fast")
    p.add_argument("--torchrun-max-restarts", type=int, default=3,
                   help="torchrun --max-restarts (its default 0 survives nothing)")
    p.add_argument("--worker-threads", type=int, default=0,
                   help="intra-op threads per worker (OMP_NUM_THREADS; 0: torch's default, "
                        "every core, so three simulated nodes oversubscribe the machine; 1 "
                        "gives each its share, as nodes with cores of their own have)")
    p.add_argument("--cores-per-node", type=float, default=0,
                   help="hold each node's workers to this many CPUs "
                        "(a cgroup quota; needs root), as nodes with cores of their own: at "
                        "0.6 three nodes fit two cores, so a join no longer slows every "
                        "step; the loopback baselines are then measured between two processes "
                        "of that share. 0: no quota, the nodes share the machine's cores")
    p.add_argument("--steps-after", type=int, default=3,
                   help="steps trained after recovery before a trial ends: the window of the "
                        "longest pause, the step after and a join's gap (more takes in a "
                        "checkpoint save after a join, with --ckpt-every)")
    p.add_argument("--start-timeout", type=float, default=120)
    p.add_argument("--recover-timeout", type=float, default=150)
    p.add_argument("--keep", action="store_true", help="keep logs and outputs")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    known = cases(args)
    names = args.cases or [n for n in known if not (args.quick and n == "torchrun-default")]
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {list(known)}", file=sys.stderr)
        return 2
    repeats = 1 if args.quick else args.repeats
    if args.cores_per_node and cgroup_cpu_reason():
        print(f"--cores-per-node: {cgroup_cpu_reason()}; run as root or drop the option",
              file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    shape = "Linear(2048, 2048) layers" if args.shape == "layers" else "one wide layer"
    state = (f"{args.state_mb:g} MB of replica state "
             f"({args.state_mb * 1e6 / STATE_BYTES_PER_PARAM / 1e6:.1f}M parameters, {shape})"
             if args.state_mb else "a 2,000-parameter model")
    cores = (f"{args.cores_per_node:g} CPUs per node (a cgroup quota each)" if args.cores_per_node
             else "the nodes share the machine's cores")
    print(f"recovery benchmark: 3 nodes x 1 gloo worker, {state}, fault on node {VICTIM} at step "
          f"{args.kill_step}, step time {args.step_time} s, checkpoint every {args.ckpt_every} "
          f"steps, elastic-rt --lease-ttl {args.lease_ttl}, torchrun-fast --rdzv-conf "
          f"{args.torchrun_fast_conf} --monitor-interval {args.torchrun_fast_monitor}; "
          f"elastic-rt collective timeout {args.collective_timeout:g} s; "
          f"{cores}; "
          f"load average {os.getloadavg()[0]:.1f}; logs in {root}", flush=True)
    etcd = None
    results: dict[str, list[Trial]] = {}
    loopback = None
    if any(known[n].fault == "join" and known[n].in_process for n in names):
        loopback = _loopback(args.cores_per_node)
        within = (f" between two processes of {args.cores_per_node:g} CPU each (a node's share)"
                  if args.cores_per_node else "")
        print(f"loopback TCP, one connection (best of 3){within}: {loopback / 1e6:.0f} MB/s",
              flush=True)
    try:
        with interruptible():
            if any(known[n].launcher == "elastic" or known[n].rdzv_backend == "etcd-v3"
                   for n in names):
                etcd = EtcdServer()
                etcd.start()
            for name in names:
                slow = name == "torchrun-default"
                n = max(1, min(repeats, args.slow_repeats)) if slow else repeats
                results[name] = run_case(known[name], args, etcd, root, n)
    except KeyboardInterrupt:
        print("interrupted; everything started was killed", file=sys.stderr)
    finally:
        if etcd is not None:
            etcd.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if results:
        print()
        print(report(results, {n: known[n] for n in results}, loopback))
        print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    measured = all(t.recovery_s is not None for ts in results.values() for t in ts)
    return 0 if results and measured else 1


if __name__ == "__main__":
    sys.exit(main())
