"""The launch agent: one per node. Rendezvous, start and watch workers, recover.

The agent never imports torch (it stays small and starts fast). Its loop:

1. Read a snapshot of the run's keys and :func:`~elastic_rt.rendezvous.rounds.decide`.
2. Propose a round when the decision says so (one proposer wins the compare).
3. For a new round it belongs to: stop the old workers, agree on the c10d store
   address (the round's first node hosts it), start the new workers.
4. Watch the workers. A failure makes the agent probe its peers: a dead peer is
   evicted at once (a membership change, free); otherwise the failure is counted
   against the job-wide restart budget and every node restarts in a new round.

A node that cannot renew its lease stops its workers before the TTL runs out
(self-fencing, from the lease thread) and joins again once etcd answers. SIGTERM
or SIGINT makes a graceful leave: workers stopped, lease revoked, peers re-form.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType

from agents.alive import AliveServer, Liveness, probe
from agents.worker_env import worker_envs
from agents.workers import WorkerExit, WorkerGroup, WorkerState
from elastic_rt.childproc import owned_temp_dir
from elastic_rt.config import (
    AGENT_DIR_ENV,
    ENDPOINT_ENV,
    EVENTS_FILE_ENV,
    LEASE_TTL_ENV,
    LOCAL_RANK_ENV,
    LOCAL_WORLD_SIZE_ENV,
    NODE_ID_ENV,
    RESTART_COUNT_ENV,
    ROUND_ENV,
    RUN_ID_ENV,
    RendezvousConfig,
)
from elastic_rt.errors import (
    EndpointUnreachableError,
    RendezvousTimeoutError,
    StoreConnectionError,
    StoreError,
)
from elastic_rt.etcd_server import free_port
from elastic_rt.events import EventSink
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import KVStore
from elastic_rt.rendezvous.lease import LeaseKeeper
from elastic_rt.membership import ack_path
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import (
    Closed,
    Limits,
    NodeInfo,
    Participate,
    Propose,
    Round,
    Snapshot,
    Wait,
    decide,
    restart_round,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything one node's agent needs."""

    rendezvous: RendezvousConfig
    command: list[str]
    """The worker command line (``python train.py --lr 3e-4``)."""
    nproc_per_node: int = 1
    max_restarts: int = 3
    """Worker failures the whole job may absorb; membership changes are free."""
    monitor_interval: timedelta = timedelta(seconds=0.1)
    node_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    host: str = "127.0.0.1"
    """Address other nodes reach this one's workers at (MASTER_ADDR when it is rank 0)."""
    events_file: str | None = None
    grace_period: timedelta = timedelta(seconds=3)
    """SIGTERM to SIGKILL when stopping workers."""
    store_wait: timedelta = timedelta(seconds=30)
    reform_timeout: timedelta = timedelta(seconds=120)
    """In-process workers that have not joined a new round by then are restarted."""


class Agent:
    """One node's launch agent. ``run()`` returns the process exit code."""

    def __init__(self, config: AgentConfig, kv: KVStore | None = None) -> None:
        self.config = config
        rdzv = config.rendezvous
        self.kv = kv or EtcdKV(rdzv.endpoint, auth=rdzv.auth)
        self.registry = RunRegistry(self.kv, rdzv.run_id)
        self.events = EventSink(
            config.events_file, source="agent", run_id=rdzv.run_id, node=config.node_id
        )
        self.workers = WorkerGroup(grace_period=config.grace_period.total_seconds())
        self.alive = AliveServer(config.host)
        self.info = NodeInfo(
            node_id=config.node_id,
            host=config.host,
            nproc=config.nproc_per_node,
            alive_addr=self.alive.address,
        )
        self.keeper = LeaseKeeper(
            self.registry, self.info, int(rdzv.lease_ttl.total_seconds()), on_fenced=self._fence
        )
        self._wake = threading.Event()
        self._leave_signal: int | None = None
        self._fenced_round: int | None = None
        self.running_round: Round | None = None
        self.restart_count = 0
        self._ever_ran = False
        self.agent_dir = owned_temp_dir("elastic-rt-agent-")
        self._awaiting_ack: tuple[int, float] | None = None
        """(round, deadline) while in-process workers re-form into a new round."""
        self._alarm_seen = 0
        self._dirty = True
        self._last_read = 0.0
        self._last_wait_report = 0.0
        self._standby = False
        """True while in-process workers wait, outside any round, to be admitted."""
        self._in_process_published = False

    # entry point ---------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends; returns the exit code for the agent process.

        Raises:
            EndpointUnreachableError: etcd did not answer at start.
            RendezvousTimeoutError: too few nodes joined within the join timeout.
        """
        self._install_signal_handlers()
        self._join()
        # Wake on what changes this node's decision, not on every registration: with
        # N nodes that would be N^2 reads. A newcomer reads after its own put and
        # proposes its own admission, so nobody else needs to hear about it.
        cancels = [
            self.kv.on_change(self.registry.key(name), self._store_changed)
            for name in ("round", "closed", "completing", "alarm")
        ]
        cancels.append(
            self.kv.on_change(self.registry.key("nodes/"), self._store_changed, deletes_only=True)
        )
        try:
            return self._loop()
        finally:
            for cancel in cancels:
                cancel()
            self.workers.stop()
            self.keeper.stop(revoke=True)
            self.alive.close()
            self.kv.close()
            shutil.rmtree(self.agent_dir, ignore_errors=True)

    def _join(self) -> None:
        try:
            snapshot = self.registry.snapshot()
            if (snapshot.closed is not None or snapshot.completing) and not snapshot.nodes:
                # A finished run with nobody left: a new launch with the same id starts afresh.
                self.kv.delete_prefix(self.registry.prefix)
            standby = (snapshot.in_process and snapshot.round is not None
                       and not (snapshot.closed or snapshot.completing)
                       and self.info.node_id not in snapshot.round.members)
            if not standby:
                self.keeper.start()
        except StoreConnectionError as exc:
            raise EndpointUnreachableError(
                f"cannot reach etcd at {self.config.rendezvous.endpoint} ({exc})",
                "Start etcd there (elastic-rt etcd) or fix --rdzv-endpoint.",
            ) from exc
        self.events.emit("node.joined", host=self.info.host, nproc=self.info.nproc)
        if standby:
            # Growing a job that recovers in place: admitting us before our workers
            # have imported torch would make every survivor wait for them.
            logger.info("node %s starts its workers before joining run %s", self.info.node_id,
                        self.registry.run_id)
            self._start_in_standby(snapshot.round)  # type: ignore[arg-type]
            return
        logger.info("node %s registered for run %s", self.info.node_id, self.registry.run_id)

    def _loop(self) -> int:
        rdzv = self.config.rendezvous
        limits = Limits(
            min_nodes=rdzv.min_nodes,
            max_nodes=rdzv.max_nodes,
            last_call=rdzv.last_call.total_seconds(),
        )
        started = time.monotonic()
        quorum_since: float | None = None
        while True:
            if self._leave_signal is not None:
                return self._leave()
            if not self._should_read():
                exit_code = self._participate(Participate(self.running_round))  # type: ignore[arg-type]
                if exit_code is not None:
                    return exit_code
                continue
            try:
                snapshot = self.registry.snapshot()
                self._last_read = time.monotonic()
            except StoreError as exc:
                logger.warning("etcd unavailable (%s); workers keep running", exc)
                self._sleep(self.config.monitor_interval.total_seconds() * 5)
                continue
            if snapshot.completing and self._finished_without_us(snapshot):
                self.registry.close("finished")
                return self._closed("finished: the job completed before this node's workers joined")
            action = decide(
                snapshot,
                self.info.node_id,
                limits,
                now=time.monotonic(),
                quorum_since=quorum_since,
                now_ms=int(time.time() * 1000),
            )
            if isinstance(action, Closed):
                return self._closed(action.reason)
            if isinstance(action, Propose):
                self._propose(action, replaced=snapshot.round)
                continue
            if isinstance(action, Wait):
                quorum_since = action.quorum_since
                if (action.stop_workers or self.running_round is not None) and not self._standby:
                    self._stop_workers(f"waiting: {action.reason}")
                if not self._ever_ran:
                    if time.monotonic() - started > rdzv.join_timeout.total_seconds():
                        raise RendezvousTimeoutError(
                            f"only {len(snapshot.nodes)} of {rdzv.min_nodes} nodes joined run "
                            f"{rdzv.run_id!r} within {rdzv.join_timeout.total_seconds():.0f} s",
                            "Start more nodes, lower --nnodes MIN, or raise --join-timeout.",
                        )
                self._report_waiting(action.reason, started)
                self._sleep(0.5)
                continue
            if snapshot.alarm and snapshot.alarm[1] > self._alarm_seen:
                self._alarm_seen = snapshot.alarm[1]
                if snapshot.alarm[0] == action.round.number and self._answer_alarm(action.round):
                    continue
            exit_code = self._participate(action)
            if exit_code is not None:
                return exit_code

    # rounds --------------------------------------------------------------------
    def _propose(self, action: Propose, replaced: Round | None = None) -> None:
        began = time.monotonic()
        self._dirty = True
        written = self.registry.propose(action)
        if written is None:
            return
        # From the round it replaces, not self.running_round: a worker failure seen
        # before the peer's key went has already cleared that, and node.lost was lost.
        lost = [m for m in (replaced.members if replaced else ()) if m not in written.members]
        for node in lost:
            self.events.emit("node.lost", round=written.number, lost=node)
        self.events.emit(
            "round.formed",
            round=written.number,
            world_size=written.world_size,
            members=list(written.members),
            reason=written.reason,
            duration_ms=int((time.monotonic() - began) * 1000),
        )
        logger.info("round %d formed: %s (%s)", written.number, ",".join(written.members), written.reason)

    def _participate(self, action: Participate) -> int | None:
        round_ = action.round
        if self._fenced_round is not None:
            # We stopped our workers while cut off; everyone restarts in a new round.
            fenced, self._fenced_round = self._fenced_round, None
            if fenced == round_.number:
                self._propose(restart_round(round_, f"{self.info.node_id} rejoined", _now_ms()))
                return None
        if self.running_round is None or self.running_round.number != round_.number:
            state, exits = self.workers.poll()
            if self.running_round is not None and state is WorkerState.FAILED:
                # Our own worker died as the round changed: a failure, not a re-form.
                return self._workers_failed(self.running_round, exits)
            if self.running_round is not None and state is WorkerState.SUCCEEDED:
                return self._succeeded()  # done as a node was admitted: never restart them
            self._start_round(round_)
            return None
        state, exits = self.workers.poll()
        if self._awaiting_ack and state is WorkerState.RUNNING:
            self._check_acks()
        if not self._in_process_published and state is WorkerState.RUNNING:
            self._publish_in_process()
        if state is WorkerState.SUCCEEDED:
            return self._succeeded()
        if state is WorkerState.FAILED:
            return self._workers_failed(round_, exits)
        self._sleep(self.config.monitor_interval.total_seconds())
        return None

    def _start_round(self, round_: Round) -> None:
        if self.running_round is not None and self._workers_follow_rounds():
            # In-process workers re-form by themselves; we only host the store address.
            if self._agree_on_store(round_) is not None:
                self.running_round = round_
                self._standby = False
                deadline = time.monotonic() + self.config.reform_timeout.total_seconds()
                self._awaiting_ack = (round_.number, deadline)
            return
        if self.running_round is not None:
            self._stop_workers(f"round {round_.number} formed")
        master = self._agree_on_store(round_)
        if master is None:
            return
        if self._ever_ran:
            self.restart_count += 1
        envs = worker_envs(
            os.environ,
            round_,
            self.info.node_id,
            run_id=self.registry.run_id,
            master=master,
            restart_count=self.restart_count,
            max_restarts=self.config.max_restarts,
            extras=self._extras(),
        )
        pids = self.workers.start(self.config.command, envs)
        self.running_round = round_
        self._ever_ran = True
        self.events.emit(
            "worker.started" if self.restart_count == 0 else "worker.restarted",
            round=round_.number,
            pids=pids,
            world_size=round_.world_size,
            restart_count=self.restart_count,
        )

    def _agree_on_store(self, round_: Round) -> tuple[str, int] | None:
        """The round's first node picks the c10d store port; the others read it.

        The store lives in that node's rank-0 worker (torchrun's env:// rendezvous)
        and is re-hosted by the first member of every new round, so it never
        outlives the node it depends on.
        """
        if round_.members[0] == self.info.node_id:
            address = f"{self.info.host}:{free_port(self.info.host)}"
            self.registry.publish_store(round_, address)
        deadline = time.monotonic() + self.config.store_wait.total_seconds()
        while time.monotonic() < deadline:
            address = self.registry.store_address(round_.number)
            if address:
                host, _, port = address.rpartition(":")
                return host, int(port)
            current = self.registry.current_round()
            if current is None or current.number != round_.number:
                return None
            if round_.members[0] not in self.registry.nodes():
                # Its host left before publishing: back to the loop, which re-forms without it.
                return None
            self._sleep(0.05)
        logger.warning("no store address for round %d; waiting for the next round", round_.number)
        return None

    def _finished_without_us(self, snapshot: Snapshot) -> bool:
        """The job completed in a round that lists us, and every other member has left.

        Seen when a node is admitted just as the others finish their last step: its
        workers would wait for a round store that is gone. It applies when we have no
        workers, or in-process workers that never joined the round (their acks say so);
        a worker that did join may still be writing its outputs, so it is never cut short.
        """
        round_ = snapshot.round
        if round_ is None or self.info.node_id not in round_.members:
            return False
        if any(m in snapshot.nodes for m in round_.members if m != self.info.node_id):
            return False
        if self.workers.poll()[0] is not WorkerState.RUNNING:
            return self.running_round is None and not self.workers.pids
        if not self._acks_in_process():
            return False
        return not any(a is not None and a["round"] >= round_.number for a in self._acks())

    def _publish_in_process(self) -> None:
        """Tell nodes that join later that this run's workers recover in place."""
        if self._acks_in_process():
            self.registry.mark_in_process()
            self._in_process_published = True

    def _acks(self) -> list[dict[str, int] | None]:
        acks: list[dict[str, int] | None] = []
        for local_rank, pid in enumerate(self.workers.pids):
            try:
                with open(ack_path(self.agent_dir, local_rank), encoding="utf-8") as handle:
                    ack = json.load(handle)
            except (OSError, ValueError):
                ack = None
            acks.append(ack if ack and ack.get("pid") == pid else None)
        return acks

    def _acks_in_process(self) -> bool:
        """Every local worker (alive or not) has announced in-process recovery."""
        acks = self._acks()
        return bool(acks) and all(a is not None and a.get("in_process") for a in acks)

    def _workers_follow_rounds(self) -> bool:
        """True when every local worker is alive and has told us it recovers in-process.

        A dead worker's ack file outlives it. Following the round with it would
        make the new round wait for a rank that never comes (and when that rank
        is 0, hosts its store), so a node with a dead worker restarts instead.
        """
        if self.workers.poll()[0] is not WorkerState.RUNNING:
            return False
        return self._acks_in_process()

    def _check_acks(self) -> None:
        assert self._awaiting_ack is not None
        number, deadline = self._awaiting_ack
        if all(a is not None and a["round"] >= number for a in self._acks()):
            self._awaiting_ack = None
        elif time.monotonic() > deadline:
            # Restart mode is the fallback, never a hang.
            logger.warning("workers did not join round %d in time; restarting them", number)
            self._awaiting_ack = None
            self._stop_workers("in-process re-form timed out")

    def _answer_alarm(self, round_: Round) -> bool:
        """A worker's collective failed: evict dead peers, or re-form if all answer.

        Returns True when membership changed or a re-form round was proposed. A peer
        that neither answers nor refuses (hung) is left to its lease.
        """
        dead, unsure = self._probe_peers(round_)
        if dead:
            return True
        if unsure or self.workers.poll()[0] is WorkerState.FAILED:
            return False  # hung peer: its lease decides; our own dead worker: handled next
        self._propose(restart_round(round_, "a collective failed; all nodes answer", _now_ms()))
        return True

    def _extras(self) -> dict[str, str]:
        extras = {
            ENDPOINT_ENV: self.config.rendezvous.endpoint,
            AGENT_DIR_ENV: self.agent_dir,
            LEASE_TTL_ENV: str(int(self.config.rendezvous.lease_ttl.total_seconds())),
        }
        extras.update(self.config.rendezvous.auth.to_env())
        if self.config.events_file:
            extras[EVENTS_FILE_ENV] = self.config.events_file
        return extras

    # worker outcomes -------------------------------------------------------------
    def _succeeded(self) -> int:
        self.registry.mark_completing()
        self.events.emit("job.finished", round=self.running_round.number if self.running_round else None)
        self.keeper.stop(revoke=True)
        remaining = [n for n in self.registry.nodes() if self.running_round and n in self.running_round.members]
        if not remaining:
            self.registry.close("finished")
        logger.info("workers finished; node %s leaves", self.info.node_id)
        return 0

    def _workers_failed(self, round_: Round, exits: list[WorkerExit]) -> int | None:
        failed = [e for e in exits if e.exitcode != 0]
        for e in failed:
            self.events.emit("worker.failed", round=round_.number, local_rank=e.local_rank, pid=e.pid, exitcode=e.exitcode)
        in_process = self._acks_in_process()
        self._stop_workers("a worker failed")
        snapshot = self.registry.snapshot()
        if snapshot.closed is not None:
            return self._closed(snapshot.closed)  # e.g. a worker's own code failed: no retry
        if snapshot.completing:
            reason = f"failed: a worker exited with {failed[0].exitcode} while the job was finishing"
            self.registry.close(reason)
            return self._closed(reason)
        round_changed = snapshot.round is None or snapshot.round.number != round_.number
        if round_changed and not in_process:
            return None  # a membership change took our workers down: free, and handled
        if not round_changed and self._probe_peers(round_)[0]:
            return None
        first = failed[0]
        what = f"worker {first.local_rank} on {self.info.node_id} exited with {first.exitcode}"
        if not self.registry.claim_failure(round_.number, what):
            return None
        count = self.registry.count_restart()
        if count > self.config.max_restarts:
            # Through _closed, so the node that spent the budget says why, like its peers.
            reason = f"failed: {what}; the restart budget of {self.config.max_restarts} is spent"
            self.registry.close(reason)
            return self._closed(reason)
        why = f"{what} (restart {count}/{self.config.max_restarts})"
        current = snapshot.round or round_
        if in_process and len(current.members) > self.config.rendezvous.min_nodes:
            self._restart_in_standby(current, why)
            return None
        if not round_changed:
            self._propose(restart_round(round_, why, _now_ms()))
        return None

    def _restart_in_standby(self, round_: Round, why: str) -> None:
        """Step out while a failed in-process worker is replaced, then ask to be let back in.

        A restart round with the same members would make the survivors wait for the
        replacement to start (seconds of importing torch). Instead the lease goes at
        once, so the survivors re-form without this node in-process, and the
        replacements start in standby (see :meth:`_start_in_standby`).
        """
        self.keeper.stop(revoke=True)
        self.events.emit("node.left", round=round_.number, reason=why)
        self.restart_count += 1
        self._start_in_standby(round_)

    def _start_in_standby(self, round_: Round) -> None:
        """Start workers outside any round; register only once they are imported.

        Used by a node joining a running in-process job and by one replacing a failed
        worker. The workers announce themselves once imported; only then does the node
        register, and the survivors admit it at a step boundary without waiting.
        Workers that do not announce in time are stopped and the node joins the normal
        way (restart mode is the fallback, never a hang).
        """
        envs = [
            {**os.environ, **self._extras(), NODE_ID_ENV: self.info.node_id,
             RUN_ID_ENV: self.registry.run_id, ROUND_ENV: "-1", LOCAL_RANK_ENV: str(i),
             LOCAL_WORLD_SIZE_ENV: str(self.info.nproc), RESTART_COUNT_ENV: str(self.restart_count)}
            for i in range(self.info.nproc)
        ]  # fmt: skip
        pids = self.workers.start(self.config.command, envs)
        self.events.emit(
            "worker.restarted" if self._ever_ran else "worker.started",
            pids=pids, restart_count=self.restart_count, standby=True,
        )
        self._ever_ran = True
        deadline = time.monotonic() + self.config.reform_timeout.total_seconds()
        while time.monotonic() < deadline and self._leave_signal is None:
            if self.workers.poll()[0] is not WorkerState.RUNNING or self._acks_in_process():
                break
            self._sleep(0.1)
        self.keeper = LeaseKeeper(
            self.registry, self.info, int(self.config.rendezvous.lease_ttl.total_seconds()),
            on_fenced=self._fence,
        )
        self.keeper.start()
        if self._acks_in_process():
            # Belong to no round yet: the round that admits us (even the current one, if it
            # still lists us) then goes through _start_round and gets its store published.
            self.running_round = dataclasses.replace(round_, number=-1)
            self._standby = True
        else:
            self._stop_workers("standby workers did not start in time")

    def _probe_peers(self, round_: Round) -> tuple[list[str], list[str]]:
        """Probe every other member; evict those whose agent is certainly gone.

        Returns (dead members, members that did not answer in time).
        """
        registered = self.registry.nodes()
        dead, unsure = [], []
        for member in round_.members:
            if member == self.info.node_id:
                continue
            info = registered.get(member)
            if info is None:
                dead.append(member)
                continue
            liveness = probe(info.alive_addr) if info.alive_addr else Liveness.UNKNOWN
            if liveness is Liveness.DEAD:
                self.registry.evict(info)
                dead.append(member)
            elif liveness is Liveness.UNKNOWN:
                unsure.append(member)
        if dead:
            logger.warning("peers gone: %s", ",".join(dead))
        return dead, unsure

    def _stop_workers(self, why: str) -> None:
        if self.workers.pids:
            logger.info("stopping workers: %s", why)
        self.workers.stop()
        self.running_round = None
        self._awaiting_ack = None

    # fencing, leaving, closing -----------------------------------------------------
    def _fence(self, why: str) -> None:
        """Called from the lease thread: stop training before others declare us dead."""
        self._fenced_round = self.running_round.number if self.running_round else None
        self.workers.stop()
        self.running_round = None
        self.events.emit("agent.fenced", reason=why)
        self._wake.set()

    def _leave(self) -> int:
        signum = self._leave_signal or signal.SIGTERM
        # Revoke first: peers re-form without waiting out our workers' grace period,
        # and a peer whose collective breaks as ours stop finds us unregistered, so
        # it counts a membership change, not a failure against the restart budget.
        self.keeper.stop(revoke=True)
        self.workers.stop()
        self.events.emit("node.left", signal=signal.Signals(signum).name)
        logger.info("node %s left on %s", self.info.node_id, signal.Signals(signum).name)
        return 128 + signum

    def _closed(self, reason: str) -> int:
        self.workers.stop()
        if reason.startswith("failed"):
            logger.error("job stopped: %s", reason)
            self.events.emit("agent.exited", reason=reason, exitcode=1)
            return 1
        self.events.emit("agent.exited", reason=reason, exitcode=0)
        return 0

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            self._leave_signal = signum
            self._wake.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _report_waiting(self, reason: str, since: float) -> None:
        """Show that a long rendezvous wait is alive: one line every 5 s, with its reason."""
        now = time.monotonic()
        if now - self._last_wait_report >= 5.0:
            self._last_wait_report = now
            logger.info("waiting for a round (%s) for %.0f s", reason, now - since)

    def _store_changed(self) -> None:
        self._dirty = True
        self._wake.set()

    def _should_read(self) -> bool:
        """Re-read the run only on a change, at least once a second, or when not running.

        Checking local workers every monitor interval costs nothing; reading the
        whole run from etcd that often would, for every node of a large job.
        """
        if self._dirty or self.running_round is None or self._awaiting_ack or self._standby:
            self._dirty = False
            return True
        return time.monotonic() - self._last_read >= 1.0

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()


def _now_ms() -> int:
    return int(time.time() * 1000)
