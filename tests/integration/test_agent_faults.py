"""Agent faults end to end: real ``elastic-rt launch`` trees on a real etcd.

The worker is the unmodified torchrun DDP script (gloo on CPU), which resumes from
its ``torch.save`` checkpoint at start. Faults are real signals to real PIDs:
a node joining late, a worker SIGKILLed (with and without restart budget), an
agent SIGTERMed (graceful leave), an agent SIGKILLed alone (its workers must die
with it). Every test also checks by PID that nothing it started outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import CLOSED, LEADER
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import TORCHRUN_SCRIPT, events, launch_args, progress

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(180)]


class Job:
    """One run id's agents, their files, and every process they ever started.

    Its own :class:`ProcessTree` samples the agents' descendants every 50 ms, so
    workers of earlier rounds are remembered too and :meth:`assert_nothing_left`
    can check each (by PID and start time, against PID reuse).
    """

    def __init__(self, etcd: EtcdServer, run_id: str, tmp: Path, *,
                 nnodes: str, steps: int, step_time: float = 0.1) -> None:
        self.etcd, self.run_id, self.tmp = etcd, run_id, tmp
        self.nnodes, self.steps, self.step_time = nnodes, steps, step_time
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.tree = ProcessTree(sample_every=0.05)

    @property
    def events_file(self) -> Path:
        return self.tmp / "events.jsonl"

    def start(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        args = launch_args(self.etcd.endpoint, self.run_id, self.nnodes, self.events_file,
                           node_id=name, extra=extra)
        script = [TORCHRUN_SCRIPT, "--steps", str(self.steps), "--ckpt", str(self.tmp / "ckpt.pt"),
                  "--ckpt-every", "2", "--progress", str(self.tmp / "progress.jsonl"),
                  "--step-time", str(self.step_time), "--width", "16"]
        log = str(self.tmp / f"{name}.log")
        proc = self.tree.elastic_rt(*args, *script, env=child_env(), log=log)
        self.agents[name] = proc
        return proc

    def rows(self, world_size: int | None = None) -> list[dict]:
        rows = progress(self.tmp / "progress.jsonl")
        return [r for r in rows if world_size in (None, r["world_size"])]

    def max_step(self, world_size: int | None = None) -> int:
        return max((r["step"] for r in self.rows(world_size)), default=0)

    def workers_of(self, name: str) -> list[int]:
        """PIDs of a node's current workers (setpriv execs, so children are workers)."""
        pids = [c.pid for c in psutil.Process(self.agents[name].pid).children()]
        self.tree.sample()
        return pids

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def wait_all(self, timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {n: p.wait(timeout=max(0.1, deadline - time.monotonic()))
                for n, p in self.agents.items()}

    def alive(self) -> list[int]:
        """PIDs of every process this job ever had that still runs."""
        return [p.pid for p in self.tree.alive()]

    def assert_nothing_left(self, timeout: float = 3.0) -> None:
        """Every agent and worker this job ever had is gone."""
        wait_until(lambda: not self.alive(), timeout, f"no process left (alive: {self.alive()})")
        assert self.tree.seen_count > len(self.agents), "the tracker saw no worker at all"


@pytest.fixture()
def kv(etcd_server: EtcdServer) -> Iterator[EtcdKV]:
    client = EtcdKV(etcd_server.endpoint)
    yield client
    client.close()


@pytest.fixture()
def job_factory(etcd_server: EtcdServer, run_id: str, tmp_path: Path) -> Iterator:
    jobs: list[Job] = []

    def make(*, nnodes: str, steps: int, run: str = run_id, step_time: float = 0.1) -> Job:
        folder = tmp_path / run
        folder.mkdir()
        job = Job(etcd_server, run, folder, nnodes=nnodes, steps=steps, step_time=step_time)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.tree.close()


def _restarts(kv: EtcdKV, run_id: str) -> int:
    item = kv.get(f"/elastic_rt/{run_id}/restarts")
    return int(item.value) if item else 0


def _assert_finished(job: Job, world_size: int) -> None:
    last = job.rows(world_size)
    assert max(r["step"] for r in last) == job.steps
    final_ranks = {r["rank"] for r in last if r["step"] == job.steps}
    assert final_ranks == set(range(world_size))


def test_a_late_fourth_agent_grows_the_world_and_training_resumes_from_the_checkpoint(
    job_factory, kv: EtcdKV
) -> None:
    # Enough steps left after step 4 (~7 s) for d's agent to start and register.
    job = job_factory(nnodes="2:4", steps=50, step_time=0.15)
    for name in ("a", "b", "c"):
        job.start(name)
    wait_until(lambda: job.max_step(3) >= 4, 90, "step 4 with world size 3")
    job.start("d")

    codes = job.wait_all(120)
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, codes
    assert job.rows(4), f"the 3-node world finished before d joined (step {job.max_step(3)})"
    _assert_finished(job, 4)
    first_grown = min(r["step"] for r in job.rows(4))
    # Resumed from the last even-step checkpoint, not from scratch and not past it.
    assert first_grown - 1 >= 4 and (first_grown - 1) % 2 == 0
    assert first_grown - 1 <= job.max_step(3)
    formed = [e for e in events(job.events_file) if e.name == "round.formed"]
    assert formed[-1].metadata["world_size"] == 4
    assert "admitting d" in formed[-1].metadata["reason"]
    assert _restarts(kv, job.run_id) == 0  # a membership change is free
    job.assert_nothing_left()


def test_a_sigkilled_worker_restarts_every_worker_and_counts_one_restart(
    job_factory, kv: EtcdKV
) -> None:
    job = job_factory(nnodes="2", steps=16)
    job.start("a")
    job.start("b")
    wait_until(lambda: job.max_step(2) >= 4, 90, "step 4 with world size 2")
    before = {r["pid"] for r in job.rows()}
    (victim,) = job.workers_of("b")
    os.kill(victim, signal.SIGKILL)

    assert job.wait_all(120) == {"a": 0, "b": 0}
    _assert_finished(job, 2)
    finishers = {r["pid"] for r in job.rows() if r["step"] == job.steps}
    assert len(finishers) == 2 and not finishers & before  # both ranks were restarted
    assert _restarts(kv, job.run_id) == 1
    evs = events(job.events_file)
    restarted = {e.node for e in evs if e.name == "worker.restarted"}
    assert restarted == {"a", "b"}
    failed = [e for e in evs if e.name == "worker.failed" and e.node == "b"]
    assert failed and failed[0].metadata["exitcode"] == -signal.SIGKILL
    job.assert_nothing_left()


def test_a_sigkilled_worker_with_no_restart_budget_stops_every_agent_with_an_error(
    job_factory, kv: EtcdKV
) -> None:
    job = job_factory(nnodes="2", steps=200)
    job.start("a", "--max-restarts", "0")
    job.start("b", "--max-restarts", "0")
    wait_until(lambda: job.max_step(2) >= 2, 90, "step 2 with world size 2")
    (victim,) = job.workers_of("b")
    os.kill(victim, signal.SIGKILL)

    codes = job.wait_all(60)
    assert all(code not in (0, None) for code in codes.values()), codes
    closed = kv.get(f"/elastic_rt/{job.run_id}/{CLOSED}")
    assert closed is not None and closed.value.decode().startswith("failed")
    for name in ("a", "b"):
        errors = [line for line in job.log(name).splitlines() if " ERROR " in line]
        assert any("restart budget of 0 is spent" in line for line in errors), job.log(name)
        # Workers may print tracebacks (prefixed "[rank0]:"); the agent must not.
        assert not [line for line in job.log(name).splitlines() if line.startswith("Traceback")]
    assert job.max_step() < job.steps
    job.assert_nothing_left()


def test_sigterm_to_an_agent_leaves_gracefully_and_the_others_reform_at_once(
    job_factory, kv: EtcdKV
) -> None:
    job = job_factory(nnodes="2:3", steps=24)
    job.start("a")
    job.start("b")
    # A long TTL for the leaver: its key vanishing quickly proves the lease was revoked.
    leaver = job.start("c", "--lease-ttl", "30")
    wait_until(lambda: job.max_step(3) >= 4, 90, "step 4 with world size 3")
    node_key = f"/elastic_rt/{job.run_id}/nodes/c"
    assert kv.get(node_key) is not None
    leaver_workers = job.workers_of("c")

    sent = time.time()
    os.kill(leaver.pid, signal.SIGTERM)
    wait_until(lambda: kv.get(node_key) is None, 5, "the leaver's node key to go", interval=0.02)
    key_gone_s = time.time() - sent
    assert leaver.wait(timeout=10) == 128 + signal.SIGTERM
    assert not set(leaver_workers) & set(job.alive())

    codes = job.wait_all(120)
    assert codes == {"a": 0, "b": 0, "c": 128 + signal.SIGTERM}, codes
    _assert_finished(job, 2)
    evs = events(job.events_file)
    assert any(e.name == "node.left" and e.node == "c" for e in evs)
    reformed = next(e for e in evs if e.name == "round.formed" and e.metadata["world_size"] == 2)
    reform_s = reformed.timestamp_ms / 1000 - sent
    print(f"leaver's key gone {key_gone_s:.2f} s and a new round {reform_s:.2f} s after SIGTERM")
    assert key_gone_s < 5  # far below the leaver's 30 s TTL
    assert reform_s < 1.5
    assert _restarts(kv, job.run_id) == 0  # leaving is a membership change, not a failure
    job.assert_nothing_left()


def test_sigkill_of_the_agent_alone_takes_its_workers_within_two_seconds(
    job_factory, kv: EtcdKV
) -> None:
    job = job_factory(nnodes="1:2", steps=20)
    job.start("a")
    victim = job.start("b")
    wait_until(lambda: job.max_step(2) >= 4, 90, "step 4 with world size 2")
    orphans = job.workers_of("b")
    assert orphans

    os.kill(victim.pid, signal.SIGKILL)  # the agent only, not its process group
    wait_until(lambda: not set(orphans) & set(job.alive()), 2,
               "the killed agent's workers to die (parent-death signal)")

    codes = job.wait_all(120)
    assert codes == {"a": 0, "b": -signal.SIGKILL}, codes
    _assert_finished(job, 1)
    assert _restarts(kv, job.run_id) == 0  # a dead peer is a membership change
    lost = [e.metadata["lost"] for e in events(job.events_file) if e.name == "node.lost"]
    assert lost == ["b"]
    job.assert_nothing_left()


def test_sigkill_of_the_leader_while_the_first_round_forms_leaves_the_others_to_form_it(
    job_factory, kv: EtcdKV
) -> None:
    # The first node to register proposes rounds; the others only watch the round keys.
    # Its lease (3 s) takes the leader key with it, and one of the others takes over.
    job = job_factory(nnodes="3", steps=6, step_time=0.05)
    prefix = f"/elastic_rt/{job.run_id}/"

    def leader() -> bytes | None:
        item = kv.get(prefix + LEADER)
        return item.value if item else None

    first = job.start("a")
    wait_until(lambda: leader() == b"a", 60, "a to lead")
    job.start("b")
    wait_until(lambda: kv.get(prefix + "nodes/b") is not None, 60, "b to register")
    os.killpg(first.pid, signal.SIGKILL)  # agent only: no round yet, so no workers
    job.start("c")
    job.start("d")

    codes = job.wait_all(150)
    assert codes == {"a": -signal.SIGKILL, "b": 0, "c": 0, "d": 0}, codes
    _assert_finished(job, 3)
    formed = [e for e in events(job.events_file) if e.name == "round.formed"]
    assert [sorted(e.metadata["members"]) for e in formed] == [["b", "c", "d"]]
    assert formed[0].node in ("b", "c", "d")
    job.assert_nothing_left()


def test_a_join_timeout_names_how_many_nodes_came_on_the_leader_and_a_follower(
    job_factory, kv: EtcdKV
) -> None:
    # Only the leader holds the registrations; a follower counts them for its message.
    job = job_factory(nnodes="3", steps=6)
    leader_key = f"/elastic_rt/{job.run_id}/{LEADER}"
    job.start("a", "--join-timeout", "12")
    wait_until(lambda: kv.get(leader_key) is not None, 60, "a to lead")
    job.start("b", "--join-timeout", "3")  # gives up while the leader is still there
    codes = job.wait_all(60)
    assert all(code not in (0, None) for code in codes.values()), codes
    assert "only 2 of 3 nodes joined run" in job.log("b"), job.log("b")
    assert "only 1 of 3 nodes joined run" in job.log("a"), job.log("a")  # b had left
    assert not [line for name in "ab" for line in job.log(name).splitlines()
                if line.startswith("Traceback")]


def test_two_run_ids_on_one_etcd_do_not_interfere(job_factory, run_id: str) -> None:
    # The same node names in both runs: shared keys would collide at once.
    jobs = [job_factory(nnodes="2", steps=6, run=f"{run_id}-{i}", step_time=0.05) for i in (1, 2)]
    for job in jobs:
        job.start("a")
        job.start("b")
    for job in jobs:
        assert job.wait_all(120) == {"a": 0, "b": 0}
        _assert_finished(job, 2)
        assert {r["world_size"] for r in job.rows()} == {2}
        assert {e.run_id for e in events(job.events_file)} == {job.run_id}
        formed = [e for e in events(job.events_file) if e.name == "round.formed"]
        assert [sorted(e.metadata["members"]) for e in formed] == [["a", "b"]]
    for job in jobs:
        job.assert_nothing_left()
