"""The soak's faults, each injected into the one running job; :data:`FAULTS` by kind.

A fault acts on the node (or etcd member) :func:`.plan.place` chose and returns what
it did as :class:`~.audit.Injection` records; whether the job survived is judged
afterwards from the event log (:func:`.audit.verdicts`). A fault that takes a node
out for good (killed, left) starts its replacement under a new node id at once, and
that start is recorded as a ``node-join``. Faults that pause a node (SIGSTOP, a cut)
block until it is back, so faults never overlap.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from elastic_rt.config import HeartbeatConfig
from elastic_rt.errors import ElasticError
from elastic_rt.harness.chaos import netns
from elastic_rt.harness.etcd_cluster import EtcdCluster
from elastic_rt.harness.ledger import ProcessLedger
from elastic_rt.harness.soak.audit import Injection
from elastic_rt.harness.soak.config import JOIN, SoakConfig
from elastic_rt.harness.soak.fleet import Fleet


@dataclass
class Target:
    """What the faults act on."""

    cfg: SoakConfig
    fleet: Fleet
    cluster: EtcdCluster
    ledger: ProcessLedger
    rng: random.Random
    stalled: bool = False
    """Training was found stalled (reported once)."""

    def landed(self, kind: str, victim: str, detail: str = "") -> Injection:
        """The record of a fault landing now."""
        self.fleet.refresh()
        return Injection(kind, victim, _now_ms(), self.fleet.round, detail=detail)


FaultFn = Callable[[Target, str], list[Injection]]


def node_kill(target: Target, victim: str) -> list[Injection]:
    """SIGKILL the node's whole tree (agent and worker); a new node replaces it."""
    record = target.landed("node-kill", victim)
    target.fleet.job.kill_node(victim)
    return [record, _replace(target, victim)]


def agent_leave(target: Target, victim: str) -> list[Injection]:
    """SIGTERM the agent alone: it leaves gracefully; a new node replaces it."""
    record = target.landed("agent-leave", victim)
    code = target.fleet.job.leave_node(victim)
    expected = 128 + signal.SIGTERM
    record = _with(record, ok=code == expected, detail=f"exit code {code}")
    return [record, _replace(target, victim)]


def node_stop(target: Target, victim: str) -> list[Injection]:
    """SIGSTOP the whole node past its peers' heartbeat window, then SIGCONT: it is
    evicted meanwhile, and must fence itself and rejoin once it runs again."""
    pause = _pause(target)
    record = target.landed("node-stop", victim, detail=f"{pause:.1f} s")
    target.fleet.job.signal_node(victim, signal.SIGSTOP)
    time.sleep(pause)
    target.fleet.refresh()
    back = _with(record, round_at_back=target.fleet.round, back_ms=_now_ms())
    target.fleet.job.signal_node(victim, signal.SIGCONT)
    return [back]


def worker_kill(target: Target, victim: str) -> list[Injection]:
    """SIGKILL the node's worker only; its agent starts it again."""
    record = target.landed("worker-kill", victim)
    pids = target.fleet.job.kill_workers(victim)
    return [_with(record, ok=bool(pids), detail=f"pids {pids}")]


def netns_cut(target: Target, victim: str) -> list[Injection]:
    """Take the namespace's link down past the heartbeat window, then up: the node is
    evicted, fences itself (or finds itself fenced when the link is back), and rejoins."""
    cut = _pause(target)
    record = target.landed("netns-cut", victim, detail=f"{cut:.1f} s")
    netns.set_node_link(up=False)
    time.sleep(cut)
    target.fleet.refresh()
    back = _with(record, round_at_back=target.fleet.round, back_ms=_now_ms())
    netns.set_node_link(up=True)
    return [back]


def etcd_restart(target: Target, victim: str) -> list[Injection]:
    """SIGKILL one etcd member, keep it down up to 1 s, start it on its data dir."""
    index = int(victim)
    down = target.rng.uniform(0.0, 1.0)
    record = target.landed("etcd-restart", f"m{index}", detail=f"down {down:.2f} s")
    try:
        target.cluster.restart(index, down_s=down)
    except ElasticError as exc:
        return [_with(record, ok=False, detail=f"{record.detail}; restart failed: {exc}")]
    pid = target.cluster.members[index].pid
    if pid is not None:
        target.ledger.adopt(pid)
    return [record]


def _pause(target: Target) -> float:
    """How long a node-stop or netns-cut lasts: the peers' eviction window and a draw."""
    heartbeat = HeartbeatConfig.from_env()
    window = heartbeat.window_s if heartbeat.interval_s > 0 else target.cfg.lease_ttl
    return window + target.rng.uniform(*target.cfg.pause_s)


def _replace(target: Target, lost: str) -> Injection:
    name = target.fleet.replace(lost)
    return target.landed(JOIN, name, detail=f"replaces {lost}")


def _with(record: Injection, **changes: Any) -> Injection:
    return dataclasses.replace(record, **changes)


def _now_ms() -> int:
    return int(time.time() * 1000)


FAULTS: dict[str, FaultFn] = {
    "node-kill": node_kill,
    "agent-leave": agent_leave,
    "node-stop": node_stop,
    "worker-kill": worker_kill,
    "netns-cut": netns_cut,
    "etcd-restart": etcd_restart,
}
