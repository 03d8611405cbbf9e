"""The soak end to end: etcd cluster, the reference run, the job, the faults, the audit.

:func:`run_soak` starts a three-member etcd cluster (on the namespace's host address
when the cut fault can run), the chaos matrix's 1-node :class:`~..chaos.run.Reference`
beside it, and the job's nodes; then it draws ``cfg.faults`` faults from a seeded RNG,
places each (:func:`.plan.place`, waiting while it may not land), injects it, and
sleeps a drawn interval. It stops drawing early only when training is about to end.
After the job, it audits: faults survived, parameters against the reference, steps
lost or repeated, re-forms, the longest-lived worker's footprint, what was left in
etcd and the temp dir, and processes left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_rt.events import Event
from elastic_rt.harness.chaos import netns
from elastic_rt.harness.chaos.audit import audit_steps
from elastic_rt.harness.chaos.config import TOLERANCE
from elastic_rt.harness.chaos.run import Reference, param_diff, sweep
from elastic_rt.harness.chaos.trial import Job, Trial
from elastic_rt.harness.etcd_cluster import EtcdCluster
from elastic_rt.harness.ledger import ProcessLedger
from elastic_rt.harness.soak import leftovers
from elastic_rt.harness.soak.audit import (Injection, Verdict, longest_stall, loss_gap,
                                           unprovoked, verdicts)
from elastic_rt.harness.soak.config import JOIN, SoakConfig
from elastic_rt.harness.soak.faults import FAULTS, Target
from elastic_rt.harness.soak.fleet import Fleet
from elastic_rt.harness.soak.footprint import Curve, curves, longest_lived
from elastic_rt.harness.soak.plan import Inject, place
from elastic_rt.harness.stacks import dump_python_stacks
from elastic_rt.harness.waits import WaitTimeout, wait_until

logger = logging.getLogger("soak")

_SAMPLE_EVERY_S = 0.2
_START_TIMEOUT_S = 300.0
_LAST_FAULT_MARGIN_S = 15.0
"""Faults stop this many seconds of training before the last step, so the last one
is over, and its node back, before the job ends."""


@dataclass(frozen=True)
class SoakResult:
    """Everything the soak measured; :attr:`passed` is the bar."""

    cfg: SoakConfig
    started_ms: int
    """Wall-clock time the soak began (event times are shown from it)."""
    seconds: float
    skipped: dict[str, str]
    injections: tuple[Injection, ...]
    verdicts: tuple[Verdict, ...]
    finished: bool
    param_diff: float
    loss_gap: tuple[int, float]
    """Steps whose global loss was compared with the reference's, and the largest gap."""
    param_count: int
    state_bytes: int
    """Of one replica: the parameters and AdamW's two moments."""
    lost: int
    repeated: int
    redone: int
    rounds: int
    paused_rounds: int
    longest_stall: tuple[float, int]
    """The longest time no step completed (s), and the step that ended it."""
    unprovoked: tuple[Event, ...]
    """Evictions and fences of nodes no fault had just hit."""
    curve: Curve | None
    etcd: leftovers.EtcdLeft | None
    temp: leftovers.TempLeft
    orphans: int
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return (self.finished and self.param_diff <= TOLERANCE and self.lost == 0
                and self.repeated == 0 and all(v.survived for v in self.verdicts)
                and self.orphans == 0 and not self.problems)


def run_soak(cfg: SoakConfig, root: Path) -> SoakResult:
    """Run one soak under ``root`` (its logs stay there) and audit it."""
    began, started_ms, temp_before = time.monotonic(), _now_ms(), leftovers.temp_entries()
    skip = netns.skip_reason() if "netns-cut" in cfg.kinds else ""
    skipped = {"netns-cut": skip} if skip else {}
    kinds = tuple(k for k in cfg.kinds if k not in skipped)
    use_netns = "netns-cut" in kinds
    ledger = ProcessLedger(sample_every=_SAMPLE_EVERY_S)
    cluster = EtcdCluster(netns.etcd_host() if use_netns else "127.0.0.1")
    reference: Reference | None = None
    trial: Trial | None = None
    try:
        cluster.start()
        for pid in cluster.pids:
            ledger.adopt(pid)
        reference = Reference(cfg.reference(), root)
        trial = Trial(cfg.chaos(), root, cluster.members[0], ledger)
        job = trial.job("soak", nnodes=cfg.nnodes, endpoint=cluster.endpoint)
        fleet = Fleet(job, minimum=cfg.min_nodes, etcd_members=len(cluster.members),
                      use_netns=use_netns)
        target = Target(cfg, fleet, cluster, ledger, random.Random(cfg.seed))
        injections = inject_all(target, kinds, trial)
        finished = _finish(target, trial)
        etcd = _etcd_left(cluster, job)
        events = job.events()
        want = reference.params()
        reference_events = reference.job.events()
    finally:
        cluster.stop()
        orphans = sweep(trial, cluster.members[0]) if trial is not None else 0
        if use_netns:
            netns.cleanup()
        if reference is not None:
            reference.close()
    lost, repeated, redone = audit_steps(events, cfg.sized_steps)
    rounds = {e.round: e for e in events if e.name == "round.formed" and e.source == "agent"}
    return SoakResult(
        cfg=cfg, started_ms=started_ms, seconds=time.monotonic() - began, skipped=skipped,
        injections=tuple(injections), verdicts=tuple(verdicts(injections, events)),
        finished=finished, param_diff=param_diff(job.out, want),
        loss_gap=loss_gap(events, reference_events),
        param_count=sum(int(t.numel()) for t in want.values()),
        state_bytes=3 * sum(int(t.numel()) * t.element_size() for t in want.values()),
        lost=lost, repeated=repeated, redone=redone, rounds=len(rounds),
        paused_rounds=sum(not e.metadata.get("world_size") for e in rounds.values()),
        longest_stall=longest_stall(events), unprovoked=tuple(unprovoked(injections, events)),
        curve=longest_lived(curves(events)), etcd=etcd,
        temp=leftovers.temp_left(temp_before, ledger.seen_pids() | {os.getpid()}),
        orphans=orphans, problems=tuple(trial.problems),
    )  # fmt: skip


def inject_all(target: Target, kinds: tuple[str, ...], trial: Trial) -> list[Injection]:
    """Start the job, then draw, place and inject ``cfg.faults`` faults, one at a time."""
    cfg, fleet, rng = target.cfg, target.fleet, target.rng
    fleet.start(cfg.nodes)
    if not fleet.job.wait_for(lambda: len(fleet.view().members) == cfg.nodes and fleet.step,
                              _START_TIMEOUT_S, f"all {cfg.nodes} nodes training"):
        return []
    done: list[Injection] = []
    last_step = cfg.sized_steps - _LAST_FAULT_MARGIN_S * cfg.steps_per_s
    for index in range(cfg.faults):
        _replace_crashed(target, trial, done)
        kind = rng.choice(kinds)
        placed, held_s = _placed(target, kind, kinds, trial)
        if fleet.failed:
            trial.problem(f"the job stopped after {index} faults: {fleet.failed}")
            break
        if _stalled(target, trial) or placed is None:
            break
        if fleet.finished or fleet.step >= last_step:
            trial.note(f"training ends at step {cfg.sized_steps}: stopped after {index} faults")
            break
        if placed.kind != "etcd-restart":
            fleet.hit(placed.victim)
        landed = FAULTS[placed.kind](target, placed.victim)
        done += [dataclasses.replace(landed[0], held_s=held_s), *landed[1:]]
        logger.info("fault %d/%d: %s %s at step %d (round %d)", index + 1, cfg.faults,
                    placed.kind, placed.victim, fleet.step, fleet.round)
        time.sleep(rng.uniform(0.5, 1.5) * cfg.interval)  # the seeded gap, not a wait
    return done


def _replace_crashed(target: Target, trial: Trial, done: list[Injection]) -> None:
    """A node whose agent ended on its own is a problem; a new node takes its place, so
    that the soak goes on measuring (its start is a ``node-join`` like any other)."""
    for name, code in target.fleet.crashed().items():
        log = target.fleet.job.dir / f"{name}.log"
        trial.problem(f"node {name} exited {code} with no fault on it (see {log})")
        done.append(target.landed(JOIN, target.fleet.replace(name), detail=f"replaces {name}"))


def _placed(target: Target, kind: str, kinds: tuple[str, ...],
            trial: Trial) -> tuple[Inject | None, float]:
    """Where ``kind`` lands, and the seconds it waited for a place; None when it never may
    (a problem), the job ended or training stalled.

    A fault that had to wait lands a drawn moment after its place opened, not at that
    instant: a place opens when a round admits a node, and landing at once would aim
    every such fault at the newcomer's first second (its join), not at a random moment.
    With ``give_way_s`` set, a fault that has waited that long gives way to one drawn
    from the kinds that can land now (the placed kind is the one injected).
    """
    cfg, fleet, began = target.cfg, target.fleet, time.monotonic()
    while True:
        placed = place(kind, fleet.view(), target.rng)
        if isinstance(placed, Inject) or fleet.ended or fleet.stalled_for() > cfg.stall_timeout:
            found = placed if isinstance(placed, Inject) else None
            return found, time.monotonic() - began
        logger.info("%s waits for %s", kind, placed.why)
        left = cfg.hold_timeout - (time.monotonic() - began)
        landable: list[str] = []

        def opened() -> bool:  # asked with a throwaway RNG: the seeded one only places
            landable.clear()
            if isinstance(place(kind, fleet.view(), random.Random(0)), Inject):
                return True
            if cfg.give_way_s is not None and time.monotonic() - began >= cfg.give_way_s:
                landable[:] = [k for k in kinds
                               if isinstance(place(k, fleet.view(), random.Random(0)), Inject)]
            return bool(landable) or fleet.ended or fleet.stalled_for() > cfg.stall_timeout

        try:
            wait_until(opened, max(0.0, left), f"a place for {kind}", interval=0.05)
        except WaitTimeout:
            trial.problem(f"{kind} waited {cfg.hold_timeout:.0f} s for {placed.why}")
            return None, time.monotonic() - began
        if landable:
            kind = target.rng.choice(landable)
            logger.info("... and gives way to %s", kind)
        time.sleep(target.rng.uniform(0.0, cfg.interval))  # the drawn moment, not a wait


def _stalled(target: Target, trial: Trial) -> bool:
    """Whether no step completed for ``stall_timeout``: a hang. The first time, it is a
    problem, and every live worker's Python stacks go to the job's folder."""
    fleet, limit = target.fleet, target.cfg.stall_timeout
    stalled = fleet.stalled_for()
    if stalled > limit and not target.stalled:
        target.stalled = True
        trial.problem(f"training stalled at step {fleet.step}: no step for {stalled:.0f} s "
                      f"(round {fleet.round}); stacks: {_dump_stacks(fleet.job)}")
    return stalled > limit


def _dump_stacks(job: Job) -> str:
    written = []
    for name in job.live():
        for pid in job.worker_pids(name):
            out = job.dir / f"stacks-{name}-{pid}.txt"
            if dump_python_stacks(pid, out):
                written.append(out.name)
    return ", ".join(written) or "none taken"


def _finish(target: Target, trial: Trial) -> bool:
    """Wait for every node to end (True: all exited 0 with the parameters written), giving
    up when training stalls rather than waiting out the job's timeout."""
    job, fleet = target.fleet.job, target.fleet

    def over() -> bool:
        fleet.refresh()
        return not job.live() or fleet.stalled_for() > target.cfg.stall_timeout

    with contextlib.suppress(WaitTimeout):
        wait_until(over, trial.cfg.trial_timeout, "the job to end", interval=0.2)
    if job.live() and _stalled(target, trial):
        return False
    return job.wait_done(trial.cfg.trial_timeout)


def _etcd_left(cluster: EtcdCluster, job: Job) -> leftovers.EtcdLeft | None:
    """What the run left in etcd once its nodes' leases had time to run out."""
    ttl = job.lease_ttl
    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: leftovers.etcd_left(cluster.endpoint, job.run_id).leased_keys == 0,
                   2 * ttl + 2, "the run's leased keys gone", interval=0.5)
    try:
        return leftovers.etcd_left(cluster.endpoint, job.run_id)
    except Exception:  # noqa: BLE001 - a figure we could not read is reported as missing
        logger.exception("reading what the run left in etcd failed")
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)
