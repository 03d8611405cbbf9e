"""The faults of DESIGN section 7, each a function that injects one into fresh jobs.

A fault starts its job(s) on the :class:`~.trial.Trial`, waits for a moment drawn
from the seeded RNG, injects, and records fault-specific checks; the common audit
(finished, parameters, lost/repeated steps, checkpoints, orphans) is done by
:func:`.run.run_trial` afterwards. :data:`FAULTS` names them for the command line.
"""

from __future__ import annotations

import contextlib
import random
import signal
import time
from dataclasses import dataclass
from typing import Callable

from elastic_rt.config import HeartbeatConfig
from elastic_rt.harness.chaos import netns
from elastic_rt.harness.chaos.audit import stale_writes
from elastic_rt.harness.chaos.trial import Job, Trial
from elastic_rt.harness.waits import WaitTimeout, wait_until

FaultFn = Callable[[Trial, random.Random], None]


@dataclass(frozen=True)
class Fault:
    inject: FaultFn
    skip_reason: Callable[[], str] = lambda: ""
    etcd_host: Callable[[], str] = lambda: "127.0.0.1"
    cleanup: Callable[[], None] = lambda: None


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

    # A tight poll: a write is in flight for milliseconds only. Missing it fails the check.
    with contextlib.suppress(WaitTimeout):
        wait_until(writing, 30, "a checkpoint write in flight", interval=0.001)
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
    pids = job.kill_workers(victim)
    trial.note(f"SIGKILL worker {pids} of {victim} at step {job.step()}")
    job.wait_for(lambda: any(e.name == "worker.restarted" and e.node == victim
                             for e in job.events()), 60, f"{victim}'s worker restarted")


def sigstop_node(trial: Trial, rng: random.Random) -> None:
    """SIGSTOP a node until it is declared dead, then SIGCONT: it fences itself and rejoins.

    Its peers declare it dead when its heartbeats stop for their window (0.4 s by
    default), or, with heartbeats off, when its lease TTL runs out.
    """
    job = trial.job()
    job.start()
    at, victim = _moment(trial, rng, high=0.4), rng.choice("abc")
    if not job.wait_step(at):
        return
    pids = job.tree(victim)
    heartbeat = HeartbeatConfig.from_env()
    declared_dead = heartbeat.window_s if heartbeat.interval_s > 0 else trial.cfg.lease_ttl
    pause = declared_dead + rng.uniform(0.5, 1.5)
    trial.note(f"SIGSTOP {victim} {pids} at step {job.step()} for {pause:.1f} s")
    job.signal_node(victim, signal.SIGSTOP)
    time.sleep(pause)
    round_at_resume = job.round()
    resumed_ms = int(time.time() * 1000)
    job.signal_node(victim, signal.SIGCONT)
    _check_fenced_and_rejoined(trial, job, victim, round_at_resume, resumed_ms)


def _check_fenced_and_rejoined(trial: Trial, job: Job, victim: str, round_at_resume: int,
                               resumed_ms: int) -> None:
    fenced = job.wait_for(lambda: any(e.name == "agent.fenced" and e.node == victim
                                      for e in job.events()), 30, f"{victim} fenced")
    trial.check(fenced, f"{victim} fenced itself (agent.fenced)")
    if any(e.name == "job.finished" and e.timestamp_ms < resumed_ms for e in job.events()):
        # the survivors recovered and finished while it was out: there is nothing to rejoin
        trial.check(True, f"{victim} had no round to rejoin: the job finished while it was out")
    else:
        def rejoined() -> bool:
            return any(e.name == "round.formed" and victim in e.metadata.get("members", ())
                       and (e.round or 0) > round_at_resume for e in job.events())

        job.wait_for(lambda: rejoined() or any(e.name == "job.finished" for e in job.events()),
                     60, f"{victim} back in a round, or the job finished")
        if rejoined():
            trial.check(True, f"{victim} rejoined a later round")
        else:
            # The job finished while its workers were starting: a rejoin goes through the
            # standby start, so that start is what it must have begun.
            trial.check(any(e.name == "worker.restarted" and e.node == victim
                            and e.metadata.get("standby") and e.timestamp_ms >= resumed_ms
                            for e in job.events()),
                        f"{victim} began its rejoin (workers in standby) before the job finished")
    job.wait_done(trial.cfg.trial_timeout)
    stale = stale_writes(job.events(), victim, round_at_resume, resumed_ms)
    trial.check(not stale, f"{victim} wrote nothing for an old round ({len(stale)} stale writes)")


def netns_cut(trial: Trial, rng: random.Random) -> None:
    """A node in its own network namespace; its veth goes down past the TTL, then up again."""
    job = trial.job()
    outside = {"GLOO_SOCKET_IFNAME": netns.VETH_HOST}
    job.start_node("a", host=netns.HOST_IP, env=outside)
    job.start_node("b", host=netns.HOST_IP, env=outside)
    job.start_node("c", prefix=("ip", "netns", "exec", netns.NAMESPACE), host=netns.NODE_IP,
                   env={"GLOO_SOCKET_IFNAME": netns.VETH_NODE})
    at = _moment(trial, rng, high=0.4)
    if not job.wait_step(at):
        return
    cut = trial.cfg.lease_ttl + rng.uniform(1.0, 3.0)
    trial.note(f"cut c off at step {job.step()} for {cut:.1f} s")
    netns.set_node_link(up=False)
    time.sleep(cut)
    round_at_heal = job.round()
    healed_ms = int(time.time() * 1000)
    netns.set_node_link(up=True)
    _check_fenced_and_rejoined(trial, job, "c", round_at_heal, healed_ms)


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
    if trial.etcd.pid is not None:
        trial.ledger.adopt(trial.etcd.pid)
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
    "netns-cut": Fault(netns_cut, skip_reason=netns.skip_reason, etcd_host=netns.etcd_host,
                       cleanup=netns.cleanup),
    "etcd-restart": Fault(etcd_restart),
    "two-jobs": Fault(two_jobs),
}
