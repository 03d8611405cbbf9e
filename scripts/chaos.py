"""Chaos matrix: inject every fault of DESIGN section 7 into real 3-node jobs.

Each fault is injected ``--trials`` times, at moments drawn from a seeded RNG (the
seed is printed), into a fresh 3-node job (one worker per node, in-process recovery,
``scripts/examples/elastic_train.py``). A 1-node reference run of the same script
and step count runs beside the first trial. Per fault the script prints one row:

- finished: every agent still alive exited 0 and the final parameters were written;
- params = ref: the final parameters equal the reference's within 1e-5;
- lost / repeated: audited from ``step.completed`` events of rank 0 (see
  :func:`audit_steps`); a step skipped means samples lost, a step redone while its
  state survived means samples repeated;
- damaged ckpts: committed checkpoints that fail ``elastic_rt.checkpoint.inspect.verify``;
- orphans: processes started by the trial (and their children) still alive after it;
- checks: what the fault itself must show (fenced and rejoined, no stale writes...).

The bar is 100 % and zeros. Run it as::

    python scripts/chaos.py --trials 2 --seed 7            # the full matrix
    python scripts/chaos.py --faults sigkill-mid-step,etcd-restart --trials 5

It needs root for the network-namespace fault (``ip netns``); without it that row
says why it was skipped. ``tests/integration/test_chaos.py`` runs one trial of four
faults through :func:`run_trial`.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from elastic_rt.etcd_server import EtcdServer  # noqa: E402
from elastic_rt.events import Event, JsonLinesTail  # noqa: E402

logger = logging.getLogger("chaos")

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
TOLERANCE = 1e-5


@dataclass(frozen=True)
class ChaosConfig:
    """How big each job is and how fast the runtime reacts."""

    steps: int = 60
    step_time: float = 0.05
    lease_ttl: int = 3
    collective_timeout: float = 6.0
    """Seconds a collective waits for a hung peer (2 x TTL: the runtime's rule, kept short)."""
    trial_timeout: float = 180.0
    every: int = 2
    """Checkpoint interval of the mid-checkpoint fault (small: a write is often in flight)."""


# processes ---------------------------------------------------------------------------
class Ledger:
    """Every process a trial starts, and their descendants, sampled while they run.

    Identity is (pid, create time), so a recycled PID is never mistaken for ours.
    """

    def __init__(self) -> None:
        self._roots: list[psutil.Process] = []
        self._seen: dict[tuple[int, float], psutil.Process] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="ledger", daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        try:
            proc = psutil.Process(pid)
            with self._lock:
                self._roots.append(proc)
                self._seen[(pid, proc.create_time())] = proc
        except psutil.Error:
            pass
        self.sample()

    def sample(self) -> None:
        with self._lock:
            roots = list(self._roots)
        for root in roots:
            try:
                kids = root.children(recursive=True)
            except psutil.Error:
                continue
            for kid in kids:
                try:
                    key = (kid.pid, kid.create_time())
                except psutil.Error:
                    continue
                with self._lock:
                    self._seen.setdefault(key, kid)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def alive(self) -> list[psutil.Process]:
        with self._lock:
            procs = list(self._seen.values())
        return [p for p in procs if _running(p)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_tree(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# one job ------------------------------------------------------------------------------
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


class Job:
    """One run id on an etcd: its nodes, event log, output and checkpoint folder."""

    def __init__(self, trial: "Trial", run_id: str, *, nnodes: str = "1:3",
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
            *prefix, sys.executable, "-m", "elastic_rt.cli", "launch",
            "--nnodes", self.nnodes, "--nproc-per-node", "1",
            "--rdzv-endpoint", f"etcd://{self.endpoint}", "--run-id", self.run_id,
            "--node-id", name, "--events-file", str(self.tail.path),
            "--lease-ttl", str(self.lease_ttl), "--last-call", "5", "--max-restarts", "5",
            *(("--local-addr", host) if host else ()),
            SCRIPT, "--steps", str(cfg.steps), "--out", str(self.out),
            "--step-time", str(self.step_time),
        ]  # fmt: skip
        if self.ckpt_dir is not None:
            args += ["--checkpoint", f"file://{self.ckpt_dir}", "--every", str(cfg.every)]
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env["ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC"] = str(cfg.collective_timeout)
        full_env.setdefault("ELASTIC_RT_LOG_LEVEL", "INFO")
        full_env.update(env or {})
        log = open(self.dir / f"{name}.log", "ab")
        proc = subprocess.Popen(args, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.trial.ledger.add(proc.pid)
        node = Node(name, proc)
        self.nodes[name] = node
        return node

    def start(self, names: str = "abc", **kwargs: object) -> None:
        for name in names:
            self.start_node(name, **kwargs)  # type: ignore[arg-type]

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
        try:
            return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return [pid]

    # faults ---------------------------------------------------------------------------
    def kill_node(self, name: str) -> None:
        """SIGKILL the whole node at once: agent and workers."""
        _kill_tree(self.tree(name))
        self.nodes[name].killed = True
        self.nodes[name].proc.wait()
        self.trial.note(f"{self.run_id}: SIGKILL node {name} at step {self.step()}")

    def wait_for(self, condition: Callable[[], object], timeout: float, what: str) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.02)
        self.trial.problem(f"{self.run_id}: timed out waiting for {what}")
        return False

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


# one trial ------------------------------------------------------------------------------
@dataclass
class Trial:
    """The fixtures of one fault injection: an etcd, a folder, a process ledger."""

    cfg: ChaosConfig
    dir: Path
    etcd: EtcdServer
    ledger: Ledger
    index: int = 0
    """Which trial of its fault this is (faults with variants alternate on it)."""
    jobs: list[Job] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def job(self, run_id: str = "job", **kwargs: object) -> Job:
        job = Job(self, run_id, **kwargs)  # type: ignore[arg-type]
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


@dataclass(frozen=True)
class TrialResult:
    fault: str
    trial: int
    seconds: float
    finished: bool
    params_equal: bool
    lost: int
    repeated: int
    damaged: int
    orphans: int
    problems: tuple[str, ...]
    checks: tuple[str, ...]
    skipped: str = ""
    redone: int = 0
    """Steps trained again because the state that did them died (work lost, not samples)."""

    @property
    def passed(self) -> bool:
        return (not self.skipped and self.finished and self.params_equal and not self.problems
                and self.lost == self.repeated == self.damaged == self.orphans == 0)


FaultFn = Callable[[Trial, random.Random], None]


def run_trial(fault: str, index: int, cfg: ChaosConfig, rng: random.Random, root: Path,
              reference: "Reference") -> TrialResult:
    """Inject ``fault`` once into fresh jobs on a fresh etcd and audit the outcome."""
    skip = FAULTS[fault].skip_reason()
    if skip:
        return TrialResult(fault, index, 0.0, False, False, 0, 0, 0, 0, (), (), skipped=skip)
    began = time.monotonic()
    trial_dir = root / f"{fault}-{index}"
    trial_dir.mkdir(parents=True)
    ledger = Ledger()
    etcd = EtcdServer(host=FAULTS[fault].etcd_host()).start()
    ledger.add(etcd.pid)  # type: ignore[arg-type]
    trial = Trial(cfg, trial_dir, etcd, ledger, index)
    try:
        FAULTS[fault].inject(trial, rng)
        finished = all(job.wait_done(max(1.0, cfg.trial_timeout - (time.monotonic() - began)))
                       for job in trial.jobs)
    except Exception as exc:  # noqa: BLE001 - a harness error is a failed trial, with its reason
        logger.exception("trial %s-%d crashed", fault, index)
        trial.problem(f"harness: {exc!r}")
        finished = False
    finally:
        FAULTS[fault].cleanup(trial)
    want = reference.params()
    equal = finished and all(_params_equal(job.out, want) for job in trial.jobs)
    lost = repeated = redone = damaged = 0
    for job in trial.jobs:
        job_lost, job_repeated, job_redone = audit_steps(job.events(), cfg.steps)
        lost, repeated, redone = lost + job_lost, repeated + job_repeated, redone + job_redone
        damaged += _damaged_checkpoints(job)
    orphans = _orphans(trial, etcd)
    result = TrialResult(fault, index, time.monotonic() - began, finished, equal, lost, repeated,
                         damaged, orphans, tuple(trial.problems), tuple(trial.checks), redone=redone)
    if result.passed:
        shutil.rmtree(trial_dir, ignore_errors=True)
    else:
        logger.warning("trial %s-%d failed; logs kept in %s", fault, index, trial_dir)
    return result


def _orphans(trial: Trial, etcd: EtcdServer) -> int:
    """Count (and kill) what outlives the trial.

    etcd is stopped and every agent still running (a trial that did not finish,
    already reported) is SIGKILLed, but not its workers: those must die with it.
    """
    etcd.stop()
    for job in trial.jobs:
        for node in job.nodes.values():
            if node.proc.poll() is None:
                node.proc.kill()
    deadline = time.monotonic() + 10
    while trial.ledger.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = trial.ledger.alive()
    for proc in left:
        trial.problem(f"orphan {proc.pid}: {' '.join(_cmdline(proc))[:120]}")
        try:
            proc.kill()
        except psutil.Error:
            pass
    trial.ledger.close()
    for job in trial.jobs:
        for node in job.nodes.values():
            if node.proc.poll() is None:
                node.proc.kill()
            node.proc.wait()
    return len(left)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]


# audits ----------------------------------------------------------------------------------
def audit_steps(events: list[Event], steps: int) -> tuple[int, int, int]:
    """(steps lost, steps repeated, steps redone) along the lineage of rank 0's steps.

    Events are read in file order (appends are atomic, so that is the true order).
    The lineage is a stack: a completed step ``s`` pops every step ``>= s`` — work
    that was undone by a recovery. Undoing is legitimate only when the state that
    did it is gone: its node is not in the round that redoes it, or that node's
    workers were restarted or fenced since. Otherwise the step counts as repeated.
    A gap in the lineage, or a final step short of ``steps``, counts as lost,
    unless another rank completed those steps: a survivor that finished a step
    rank 0 did not (a collective can end on some ranks only) hands its state on.
    Legitimately undone steps are counted as redone: work lost, not samples.
    """
    members: dict[int, tuple[str, ...]] = {}
    state_lost_at: dict[str, list[int]] = {}
    lineage: list[tuple[int, int, str]] = []  # (step, event index, node)
    lost = repeated = redone = 0
    done_anywhere: set[int] = set()
    for index, event in enumerate(events):
        if event.name == "round.formed" and event.source == "agent" and event.round is not None:
            members[event.round] = tuple(event.metadata.get("members", ()))
        elif event.name in ("worker.started", "worker.restarted", "agent.fenced"):
            state_lost_at.setdefault(event.node or "", []).append(index)
        if event.name == "step.completed" and event.step is not None:
            done_anywhere.add(event.step)
        if event.name != "step.completed" or event.rank != 0 or event.step is None:
            continue
        while lineage and lineage[-1][0] >= event.step:
            _, done_at, node = lineage.pop()
            gone = node not in members.get(event.round if event.round is not None else -1, (node,))
            restarted = any(done_at < i < index for i in state_lost_at.get(node, ()))
            if gone or restarted:
                redone += 1
            else:
                repeated += 1
        expected = lineage[-1][0] + 1 if lineage else 1
        lost += sum(s not in done_anywhere for s in range(expected, event.step))
        lineage.append((event.step, index, event.node or ""))
    final = lineage[-1][0] if lineage else 0
    return lost + max(0, steps - final), repeated, redone


def _params_equal(path: Path, want: dict) -> bool:
    import torch

    try:
        got = torch.load(path)
    except (OSError, RuntimeError, EOFError):
        return False
    if set(got) != set(want):
        return False
    return all(torch.allclose(got[k], want[k], atol=TOLERANCE, rtol=0) for k in want)


def _damaged_checkpoints(job: Job) -> int:
    if job.ckpt_dir is None or not job.ckpt_dir.exists():
        return 0
    from elastic_rt.checkpoint.inspect import verify

    ok, lines = verify(f"file://{job.ckpt_dir}")
    committed = [line for line in lines if line.startswith("step-")]
    job.trial.check(bool(committed), f"{job.run_id}: committed checkpoints exist ({len(committed)})")
    return 0 if ok else sum("CORRUPT" in line for line in lines)


# the reference run ---------------------------------------------------------------------------
class Reference:
    """A 1-node run of the same script and steps, on its own etcd, started at once."""

    def __init__(self, cfg: ChaosConfig, root: Path) -> None:
        self.dir = root / "reference"
        self.dir.mkdir(parents=True)
        self.ledger = Ledger()
        self.etcd = EtcdServer().start()
        self.trial = Trial(cfg, self.dir, self.etcd, self.ledger)
        self.job = self.trial.job("reference", nnodes="1")
        self.job.start_node("solo")
        self._params: dict | None = None

    def params(self) -> dict:
        if self._params is None:
            import torch

            if not self.job.wait_done(self.trial.cfg.trial_timeout):
                raise RuntimeError(f"the reference run failed: {self.trial.problems}; "
                                   f"see {self.dir}")
            self._params = torch.load(self.job.out)
            self.close()
        return self._params

    def close(self) -> None:
        _orphans(self.trial, self.etcd)


# the faults ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    inject: FaultFn
    skip_reason: Callable[[], str] = lambda: ""
    etcd_host: Callable[[], str] = lambda: "127.0.0.1"
    cleanup: Callable[[Trial], None] = lambda trial: None


def _moment(trial: Trial, rng: random.Random, low: float = 0.15, high: float = 0.6) -> int:
    """A step drawn uniformly between ``low`` and ``high`` of the run."""
    steps = trial.cfg.steps
    return rng.randint(max(2, int(steps * low)), max(3, int(steps * high)))


def sigkill_mid_step(trial: Trial, rng: random.Random) -> None:
    """SIGKILL a whole node at a random step; a replacement joins once the rest recovered."""
    job = trial.job()
    job.start()
    at, victim = _moment(trial, rng), rng.choice("abc")
    if job.wait_step(at):
        time.sleep(rng.uniform(0, trial.cfg.step_time))  # anywhere inside the step
        job.kill_node(victim)
        if job.wait_step(at + 3):
            job.start_node("d")


def sigkill_mid_rendezvous(trial: Trial, rng: random.Random) -> None:
    """Kill during start-up (even trials), or a second node while the round for the first loss
    forms (odd trials)."""
    job = trial.job()
    job.start()
    first, second = rng.sample("abc", 2)
    if trial.index % 2 == 0:
        delay = rng.uniform(0.2, 6.0)
        trial.note(f"start-up kill of {first} after {delay:.2f} s")
        time.sleep(delay)
        job.kill_node(first)
        return
    at = _moment(trial, rng)
    if not job.wait_step(at):
        return
    before = job.round()
    job.kill_node(first)
    if rng.random() < 0.5:
        job.wait_for(lambda: job.round() > before, 30, "the round after the first loss")
    else:
        time.sleep(rng.uniform(0.0, 0.5))
    trial.note(f"second kill {second}: round {job.round()} (was {before})")
    job.kill_node(second)


def sigkill_mid_checkpoint(trial: Trial, rng: random.Random) -> None:
    """SIGKILL a node while a checkpoint folder exists without its manifest (write in flight)."""
    job = trial.job(checkpoint=True)
    job.start()
    at, victim = _moment(trial, rng), rng.choice("abc")
    if not job.wait_step(at):
        return
    assert job.ckpt_dir is not None
    ckpt_dir = job.ckpt_dir

    def writing() -> bool:
        try:
            folders = [p for p in ckpt_dir.iterdir() if p.is_dir()]
            return any(not (p / "manifest.json").exists() and any(p.iterdir()) for p in folders)
        except OSError:
            return False

    deadline = time.monotonic() + 30
    while not writing() and time.monotonic() < deadline:
        time.sleep(0.001)
    trial.check(writing(), "caught a checkpoint write in flight")
    job.kill_node(victim)


def sigkill_worker(trial: Trial, rng: random.Random) -> None:
    """SIGKILL one worker process only; its agent restarts it, the others stay in-process."""
    job = trial.job()
    job.start()
    at, victim = _moment(trial, rng), rng.choice("abc")
    if not job.wait_step(at):
        return
    time.sleep(rng.uniform(0, trial.cfg.step_time))
    pids = job.worker_pids(victim)
    trial.note(f"SIGKILL worker {pids} of {victim} at step {job.step()}")
    _kill_tree(pids)
    job.wait_for(lambda: any(e.name == "worker.restarted" and e.node == victim
                             for e in job.events()), 60, f"{victim}'s worker restarted")


def sigstop_node(trial: Trial, rng: random.Random) -> None:
    """SIGSTOP a node past its lease TTL, then SIGCONT: it fences itself and rejoins."""
    job = trial.job()
    job.start()
    at, victim = _moment(trial, rng, high=0.4), rng.choice("abc")
    if not job.wait_step(at):
        return
    pids = job.tree(victim)
    pause = trial.cfg.lease_ttl + rng.uniform(1.0, 3.0)
    trial.note(f"SIGSTOP {victim} {pids} at step {job.step()} for {pause:.1f} s")
    _kill_tree(pids, signal.SIGSTOP)
    time.sleep(pause)
    round_at_resume = job.round()
    resumed_ms = int(time.time() * 1000)
    _kill_tree(pids, signal.SIGCONT)
    _check_fenced_and_rejoined(trial, job, victim, round_at_resume, resumed_ms)


def _check_fenced_and_rejoined(trial: Trial, job: Job, victim: str, round_at_resume: int,
                               resumed_ms: int) -> None:
    fenced = job.wait_for(lambda: any(e.name == "agent.fenced" and e.node == victim
                                      for e in job.events()), 30, f"{victim} fenced")
    trial.check(fenced, f"{victim} fenced itself (agent.fenced)")
    rejoined = job.wait_for(
        lambda: any(e.name == "round.formed" and victim in e.metadata.get("members", ())
                    and (e.round or 0) > round_at_resume for e in job.events()),
        60, f"{victim} back in a round")
    trial.check(rejoined, f"{victim} rejoined a later round")
    job.wait_done(trial.cfg.trial_timeout)
    stale = _stale_writes(job.events(), victim, round_at_resume, resumed_ms)
    trial.check(not stale, f"{victim} wrote nothing for an old round ({len(stale)} stale writes)")


def _stale_writes(events: list[Event], victim: str, current: int, since_ms: int) -> list[Event]:
    """What the victim's old workers did for an old round after they woke up.

    A checkpoint commit is always stale. A step completed in an old round is stale
    only when no other node completed it in that round: a step whose collective
    finished just before the pause is logged late, not trained on alone.
    """
    done_by_others = {(e.round, e.step) for e in events
                      if e.name == "step.completed" and e.node != victim}
    return [e for e in events
            if e.node == victim and e.source == "worker" and e.timestamp_ms > since_ms
            and e.round is not None and e.round < current
            and (e.name == "checkpoint.committed"
                 or (e.name == "step.completed" and (e.round, e.step) not in done_by_others))]


# network namespace ---------------------------------------------------------------------------
_NS_HOST_IP, _NS_NODE_IP = "10.213.7.1", "10.213.7.2"
_NS_NAME = f"ert-chaos-{os.getpid()}"
_VETH_HOST, _VETH_NODE = f"ertc{os.getpid() % 100000}h", f"ertc{os.getpid() % 100000}n"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def _netns_skip_reason() -> str:
    if shutil.which("ip") is None:
        return "skipped: no 'ip' command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "skipped: network namespaces need root"
    probe = f"{_NS_NAME}-probe"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"skipped: 'ip netns add' is not permitted here ({made.stderr.strip()})"
    _ip("netns", "del", probe)
    return ""


def _netns_setup() -> None:
    steps = [
        ("netns", "add", _NS_NAME),
        ("link", "add", _VETH_HOST, "type", "veth", "peer", "name", _VETH_NODE),
        ("link", "set", _VETH_NODE, "netns", _NS_NAME),
        ("addr", "add", f"{_NS_HOST_IP}/24", "dev", _VETH_HOST),
        ("link", "set", _VETH_HOST, "up"),
        ("-n", _NS_NAME, "addr", "add", f"{_NS_NODE_IP}/24", "dev", _VETH_NODE),
        ("-n", _NS_NAME, "link", "set", _VETH_NODE, "up"),
        ("-n", _NS_NAME, "link", "set", "lo", "up"),
    ]
    for args in steps:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _netns_cleanup(trial: Trial) -> None:
    _ip("link", "del", _VETH_HOST)
    _ip("netns", "del", _NS_NAME)


def _netns_etcd_host() -> str:
    _netns_cleanup(None)  # type: ignore[arg-type]  # leftovers of a crashed run
    _netns_setup()
    return _NS_HOST_IP


def netns_cut(trial: Trial, rng: random.Random) -> None:
    """A node in its own network namespace; its veth goes down past the TTL, then up again."""
    job = trial.job()
    outside = {"GLOO_SOCKET_IFNAME": _VETH_HOST}
    job.start_node("a", host=_NS_HOST_IP, env=outside)
    job.start_node("b", host=_NS_HOST_IP, env=outside)
    job.start_node("c", prefix=("ip", "netns", "exec", _NS_NAME), host=_NS_NODE_IP,
                   env={"GLOO_SOCKET_IFNAME": _VETH_NODE})
    at = _moment(trial, rng, high=0.4)
    if not job.wait_step(at):
        return
    cut = trial.cfg.lease_ttl + rng.uniform(1.0, 3.0)
    trial.note(f"cut c off at step {job.step()} for {cut:.1f} s")
    _ip("-n", _NS_NAME, "link", "set", _VETH_NODE, "down")
    time.sleep(cut)
    round_at_heal = job.round()
    healed_ms = int(time.time() * 1000)
    _ip("-n", _NS_NAME, "link", "set", _VETH_NODE, "up")
    _check_fenced_and_rejoined(trial, job, "c", round_at_heal, healed_ms)


# etcd and neighbours --------------------------------------------------------------------------
def etcd_restart(trial: Trial, rng: random.Random) -> None:
    """SIGKILL etcd and restart it on its data dir; training goes on; then a node dies.

    Runs with the launcher's default lease TTL (5 s). A node fences itself after
    TTL - 1 s without renewal, by design; on a busy 2-core host etcd takes 1.5-2.5 s
    to come back healthy (plus up to 0.5 s of gRPC reconnect backoff), which is
    more than the 2 s a 3 s TTL leaves, so nodes would fence rather than go on.
    """
    # Slower steps: training must outlast etcd's restart (seconds on a loaded 2-core host,
    # health check included) for a membership change to follow.
    job = trial.job(lease_ttl=5, step_time=0.5)
    job.start()
    at = _moment(trial, rng, low=0.1, high=0.2)
    if not job.wait_step(at):
        return
    down = rng.uniform(0.0, 1.0)
    before = job.step()
    trial.note(f"etcd SIGKILL at step {before}, down {down:.2f} s before restart")
    trial.etcd.kill()
    time.sleep(down)
    trial.etcd.restart()
    trial.ledger.add(trial.etcd.pid)  # type: ignore[arg-type]
    # Training runs on while etcd is away, so the membership change comes at once.
    live = job.live()
    if not live or job.step() > trial.cfg.steps - 3:
        trial.problem("the job ended before a membership change could follow the restart")
        return
    round_before = job.round()
    job.kill_node(rng.choice(live))
    formed = job.wait_for(lambda: job.round() > round_before, 60, "a round after the restart")
    trial.check(formed, "the next membership change formed a round")
    job.wait_done(trial.cfg.trial_timeout)
    fenced = [e.node for e in job.events() if e.name == "agent.fenced"]
    trial.check(job.step() > before and not fenced,
                f"training went on through the etcd restart (fenced: {fenced})")


def two_jobs(trial: Trial, rng: random.Random) -> None:
    """Two 3-node jobs with the same node names on one etcd; one loses a node."""
    jobs = [trial.job("job-1"), trial.job("job-2")]
    for job in jobs:
        job.start()
    hit = rng.choice(jobs)
    at, victim = _moment(trial, rng), rng.choice("abc")
    if hit.wait_step(at):
        hit.kill_node(victim)
    for job in jobs:
        job.wait_done(trial.cfg.trial_timeout)
    other = jobs[1] if hit is jobs[0] else jobs[0]
    foreign = [e for e in other.events() if e.run_id != other.run_id]
    rounds = [e.round for e in other.events() if e.name == "round.formed"]
    trial.check(not foreign and rounds == [0],
                f"{other.run_id} saw no trace of {hit.run_id} (rounds {rounds})")


FAULTS: dict[str, Fault] = {
    "sigkill-mid-step": Fault(sigkill_mid_step),
    "sigkill-mid-rendezvous": Fault(sigkill_mid_rendezvous),
    "sigkill-mid-checkpoint": Fault(sigkill_mid_checkpoint),
    "sigkill-worker": Fault(sigkill_worker),
    "sigstop-node": Fault(sigstop_node),
    "netns-cut": Fault(netns_cut, skip_reason=_netns_skip_reason, etcd_host=_netns_etcd_host,
                       cleanup=_netns_cleanup),
    "etcd-restart": Fault(etcd_restart),
    "two-jobs": Fault(two_jobs),
}


# the table -----------------------------------------------------------------------------------
def table(results: list[TrialResult]) -> str:
    """One row per fault: the bar is 100 % and zeros."""
    head = ("fault", "trials", "finished", "params=ref", "lost", "repeated", "damaged ckpts",
            "orphans", "checks", "redone", "max s")
    rows = [head]
    for fault in dict.fromkeys(r.fault for r in results):
        mine = [r for r in results if r.fault == fault]
        if mine[0].skipped:
            rows.append((fault, "0", "-", "-", "-", "-", "-", "-", mine[0].skipped, "-", "-"))
            continue
        n = len(mine)
        checks = [c for r in mine for c in r.checks]
        failed = sum(c.startswith("FAILED") for c in checks)
        rows.append((
            fault, str(n), _pct(sum(r.finished for r in mine), n),
            _pct(sum(r.params_equal for r in mine), n), str(sum(r.lost for r in mine)),
            str(sum(r.repeated for r in mine)), str(sum(r.damaged for r in mine)),
            str(sum(r.orphans for r in mine)),
            f"{len(checks) - failed}/{len(checks)} ok" if checks else "-",
            str(sum(r.redone for r in mine)), f"{max(r.seconds for r in mine):.0f}",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(k: int, n: int) -> str:
    return f"{100 * k // n} % ({k}/{n})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2, help="injections per fault")
    parser.add_argument("--seed", type=int, default=None, help="RNG seed (default: random, printed)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of: "
                        + ", ".join(FAULTS))
    parser.add_argument("--steps", type=int, default=ChaosConfig.steps)
    parser.add_argument("--workdir", default=None, help="where trial folders go (kept on failure)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s",
                        stream=sys.stderr)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; choose from {list(FAULTS)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"chaos: seed {seed}, {args.trials} trial(s) of {len(faults)} fault(s)", flush=True)
    rng = random.Random(seed)
    cfg = ChaosConfig(steps=args.steps)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="elastic-rt-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    reference = Reference(cfg, root)
    results: list[TrialResult] = []
    try:
        for fault in faults:
            for index in range(args.trials):
                result = run_trial(fault, index, cfg, rng, root, reference)
                results.append(result)
                print(f"  {fault} #{index}: {'PASS' if result.passed else result.skipped or 'FAIL'}"
                      f" in {result.seconds:.0f} s"
                      + "".join(f"\n    - {p}" for p in result.problems), flush=True)
                if result.skipped:
                    break
    finally:
        reference.close()
    print(f"\nchaos: seed {seed}\n{table(results)}")
    return 0 if all(r.passed or r.skipped for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
