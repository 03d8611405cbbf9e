"""The launch agent: one per node. Rendezvous, start and watch workers, recover.

The agent never imports torch (it stays small and starts fast), and decides
nothing itself: each turn of its loop it observes (the run's keys, its workers,
their acknowledgements) and hands the observation to :func:`agents.dispatch.carry_out`,
which asks :func:`agents.policy.decide` and calls back one of the agent's hands per
action: propose a round, agree on its store and start the workers, stop them, probe
the peers, claim and count a failure. What an action did comes back to the policy
as an observation; the agent never changes its state itself.

A node that cannot renew its lease stops its workers before the TTL runs out
(self-fencing, from the lease thread) and joins again once etcd answers. SIGTERM,
SIGINT or a preemption notice (``--preemption-notice``, :mod:`agents.preemption`) makes
the node leave at its workers' next step boundary when they recover in place, else at
once (a second signal too): lease revoked, workers stopped, peers re-form
(:mod:`agents.policy.leaving`).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable, NoReturn, TypeVar

from agents import policy
from agents.alive import AliveServer, probe_members
from agents.config import AgentConfig
from agents.dispatch import Driver, Exited, carry_out
from agents.etcd_retry import again
from agents.heartbeat import Heartbeat
from agents.inbox import Inbox
from agents.local_workers import LocalWorkers
from agents.metrics import MetricsServer, NodeMetrics
from agents.policy import AgentState, Observation, Phase
from agents.preemption import NoticePoller
from agents.round_io import agree_on_store, propose_round, report_root_cause
from agents.run_watch import RunWatch
from agents.worker_state import WorkerExit, WorkerState
from elastic_rt.errors import EndpointUnreachableError, StoreConnectionError, StoreError
from elastic_rt.events import EventSink
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import KVStore
from elastic_rt.rendezvous.lease import LeaseKeeper
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous import rounds
from elastic_rt.rendezvous.rounds import NodeInfo, Round, Snapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Agent:
    """One node's launch agent. ``run()`` returns the process exit code."""

    def __init__(self, config: AgentConfig, kv: KVStore | None = None) -> None:
        self.config = config
        rdzv = config.rendezvous
        self.settings = config.settings()
        self.kv = kv or EtcdKV(rdzv.endpoint, auth=rdzv.auth)
        self.registry = RunRegistry(self.kv, rdzv.run_id)
        self.events = EventSink(config.events_file, source="agent", run_id=rdzv.run_id,
                                node=config.node_id)
        self.workers = LocalWorkers(config, self.events)
        self.alive = AliveServer(config.host)
        self.info = NodeInfo(node_id=config.node_id, host=config.host,
                             nproc=config.nproc_per_node, alive_addr=self.alive.address)
        self.inbox = Inbox()
        self.watch = RunWatch(self.registry, self.inbox)
        self.keeper = self._lease_keeper()
        self.heartbeat = Heartbeat(self.registry, config.node_id, config.heartbeat, self.events,
                                   on_evicted=self.inbox.changed,
                                   cut_off_since=lambda: self.keeper.failed_at)
        self.driver = Driver(self.settings)
        self.notices = (NoticePoller(config.preemption_notice, self.inbox.preempted,
                                     every=config.preemption_poll.total_seconds())
                        if config.preemption_notice is not None else None)
        self.metrics = (NodeMetrics(rdzv.run_id, config.node_id, max_restarts=config.max_restarts)
                        if config.metrics_port is not None else None)
        self._metrics_server: MetricsServer | None = None
        self._started = self._last_wait_report = 0.0
        self._waiting_for: str | None = None
        """The reason of the last ``node.waiting`` event, until a round admits us."""

    # entry point ---------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends; returns the exit code for the agent process.

        Raises:
            EndpointUnreachableError: etcd did not answer at start.
            RendezvousTimeoutError: too few nodes joined within the join timeout.
        """
        self.inbox.leave_on_signals()
        if self.notices is not None:
            self.notices.start()
        self._started = time.monotonic()
        if self.metrics is not None and self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics, self.config.events_file or "",
                                                 port=self.config.metrics_port,
                                                 host=self.config.host)
        self.heartbeat.start()
        try:
            self._join()
            while True:
                code = self._step()
                if code is not None:
                    return code
        finally:
            if self.notices is not None:
                self.notices.stop()
            self.heartbeat.stop()
            self.watch.close()
            self.workers.close()
            self.keeper.stop(revoke=True)
            self.alive.close()
            if self._metrics_server is not None:
                self._metrics_server.close()
            self.kv.close()

    def _joined_once_etcd_answers(self) -> tuple[Snapshot, bool]:
        """Read the run and register (or, in standby, clear a stale registration),
        retrying an etcd that fails a call for ``--etcd-wait``: the run and whether this
        node joins in standby.

        A node and its etcd are often started at once (one job script, one pod spec), and
        etcd takes a moment to answer; failing at once would make the user order them. A
        cluster member restarting fails a call or two too (a soak's node ended here on one
        reset connection, after its first call had succeeded).

        Raises:
            EndpointUnreachableError: etcd still failed after the wait.
        """
        wait_s = self.config.rendezvous.etcd_wait.total_seconds()
        endpoint = self.config.rendezvous.endpoint
        try:
            return again(self._join_once, f"the node's first calls (etcd at {endpoint} does not "
                         "answer yet, --etcd-wait)", within=wait_s, poll=0.5)
        except StoreConnectionError as exc:
            raise EndpointUnreachableError(
                f"cannot reach etcd at {endpoint} within --etcd-wait {wait_s:g} s ({exc})",
                "Start etcd there (elastic-rt etcd) or fix --rdzv-endpoint.",
            ) from exc

    def _join_once(self) -> tuple[Snapshot, bool]:
        """One try of :meth:`_joined_once_etcd_answers`; each call may be repeated."""
        snapshot = self.registry.preview()
        if policy.is_stale_run(snapshot):
            self.kv.delete_prefix(self.registry.prefix)
        standby = policy.joins_in_standby(snapshot)
        if standby:
            self._evict_stale_registration()
        elif not self.keeper.is_started:
            self.keeper.start()
        self.registry.publish_limits(max_restarts=self.config.max_restarts,
                                     max_nodes=self.config.rendezvous.max_nodes)
        return snapshot, standby

    def _join(self) -> None:
        snapshot, standby = self._joined_once_etcd_answers()
        self.events.emit("node.joined", host=self.info.host, nproc=self.info.nproc)
        if standby and snapshot.round is not None:
            logger.info("node %s starts its workers before joining run %s", self.info.node_id,
                        self.registry.run_id)
            carry_out(self, self.driver, policy.JoiningInPlace(snapshot.round))
            return
        logger.info("node %s registered for run %s", self.info.node_id, self.registry.run_id)

    # one turn of the loop: observe, decide, act ------------------------------------
    @property
    def state(self) -> AgentState:
        return self.driver.state

    def _step(self) -> int | None:
        if self.inbox.take_fenced():
            carry_out(self, self.driver, policy.Fenced())  # stops the workers again
        observation = self._observe()
        if self.metrics is not None and observation.snapshot is not None \
                and observation.snapshot.round is not None:
            self.metrics.saw_round(observation.snapshot.round)
        code = carry_out(self, self.driver, observation)
        self.heartbeat.watch(self._watched_round())  # a hung peer is evicted in under a second
        return code

    def _watched_round(self) -> Round | None:
        """The round whose next member this node watches: its workers', and while it
        settles a failure of its own or waits for its replacement workers' ranks, the
        round it is still a member of (its successor in the ring went unwatched then: a
        peer that stopped behind it stayed, in the soak, until its lease ran out)."""
        running = self.state.running
        decided = self.driver.rendezvous
        if (running is None or running.number < 0) \
                and self.state.phase in (Phase.SETTLING, Phase.STANDBY) \
                and isinstance(decided, rounds.Participate):
            return decided.round
        return running

    def _observe(self, *, read: bool = True) -> Observation:
        """The run (when due; not with ``read=False``) and the local workers, now."""
        leave_signal = self.inbox.leave_signal
        snapshot, store_error = (None, False) if leave_signal is not None or not read else (
            self.watch.read(self.state, self.settings))
        workers, exits = self.workers.poll()
        notice = self.inbox.notice
        return Observation(
            now=time.monotonic(), now_ms=_now_ms(), snapshot=snapshot, store_error=store_error,
            workers=workers, exits=tuple(exits), acks=self.workers.acks(),
            waited=time.monotonic() - self._started, leave_signal=leave_signal, notice=notice,
            left=self.workers.left() if notice is not None else (),
        )  # fmt: skip

    # the hands: each action, carried out (see agents.dispatch) -----------------------
    def propose(self, action: policy.ProposeRound) -> None:
        self.inbox.reread()
        try:
            propose_round(self.watch.propose, self.events, action)
        except StoreError as exc:  # nothing written: the next look decides again
            logger.warning("proposing round %d failed (%s); looking again",
                           action.proposal.round.number, exc)

    def start_workers(self, action: policy.StartWorkers) -> policy.WorkersStarted | None:
        self.heartbeat.watch(action.round)  # see _agree_on_store
        master = self._agree_on_store(action.round)
        if master is None:
            return None
        self.workers.start_in(action.round, master, first=action.first)
        self._waiting_for = None
        return policy.WorkersStarted(action.round)

    def follow_round(self, action: policy.FollowRound) -> policy.RoundFollowed | None:
        self.heartbeat.watch(action.round)  # see _agree_on_store
        if self._agree_on_store(action.round) is None:
            return None
        self._waiting_for = None
        return policy.RoundFollowed(action.round, now=time.monotonic())

    def _agree_on_store(self, round_: Round) -> tuple[str, int] | None:
        """Up to ``store_wait``. The heartbeat already watches our successor in ``round_``
        meanwhile: it is only retargeted between two turns of the loop, and a node killed
        right after the round admitted it went unwatched while its watcher waited here
        (noticed by its lease 7.6 s later, docs/soak.md finding 6)."""
        return agree_on_store(self.registry, round_, self.info, wait=self.config.store_wait,
                              sleep=self.inbox.sleep)

    def stop_workers(self, action: policy.StopWorkers) -> None:
        self.workers.stop(action.why, grace=action.grace)

    def publish_in_process(self, action: policy.PublishInProcess) -> None:
        self._etcd(self.registry.mark_in_process, "to mark the run in-process")

    def start_in_standby(self, action: policy.StartInStandby) -> policy.StandbyStarted:
        """Start workers outside any round; register only once they are imported.

        A member without ranks (``register`` false: its replacements, at the minimum node
        count) still watches its successor in the round while they import (up to the
        reform timeout), as while it settles the failure (:meth:`_watched_round`)."""
        if not action.register:
            self.heartbeat.watch(action.round)
        self.workers.start_standby(action.restart_count, first=action.first)
        self.workers.wait_announced(self.config.reform_timeout.total_seconds(),
                                    give_up=lambda: self.inbox.wants_to_leave,
                                    sleep=self.inbox.sleep)
        workers, exits = self.workers.poll()
        if workers is WorkerState.FAILED:  # not registered: replaced first (the policy)
            return policy.StandbyStarted(action.round, announced=False, registered=False,
                                         exits=tuple(exits))
        if action.register:
            self.keeper = self._registered_once_etcd_answers()
        return policy.StandbyStarted(action.round, announced=self.workers.in_process(),
                                     registered=action.register)

    def unregister(self, action: policy.Unregister) -> None:
        """Stop renewing the lease and revoke it: the node is no longer registered (and
        the lease thread does not fence it); :meth:`start_in_standby` registers again."""
        logger.info("node %s steps aside while its standby workers are replaced: %s",
                    self.info.node_id, action.why)
        self.keeper.stop(revoke=True)
        self._waiting_for = None  # waiting again once registered: node.waiting says so

    def _registered_once_etcd_answers(self) -> LeaseKeeper:
        """Register on a new lease, retrying an etcd that fails the call (a cluster member
        restarting ended the agent here in the soak) for ``--etcd-wait``.

        Raises:
            StoreError: etcd still failed the registration after the wait.
        """
        deadline = time.monotonic() + self.config.rendezvous.etcd_wait.total_seconds()
        while True:
            keeper = self._lease_keeper()
            try:
                keeper.start()
                return keeper
            except StoreError as exc:
                if time.monotonic() >= deadline or self.inbox.wants_to_leave:
                    raise
                logger.warning("registering failed (%s); retrying", exc)
                self.inbox.sleep(self.settings.retry_after.total_seconds())

    def gather_failure(self, action: policy.HandleFailure) -> policy.FailureSeen:
        """Say which workers failed, stop the others, and learn what the failure costs."""
        first = self.workers.report_failed(action.round, action.exits)
        in_process = self.workers.in_process()
        self.workers.stop("a worker failed")
        step = (self._etcd(self.registry.progress, "to read the progress") or {}).get("step")
        cause = self.workers.root_cause(action.round, action.exits, self.info.host,
                                        step if isinstance(step, int) else None)
        return policy.FailureSeen(policy.FailureFacts(
            action.round, self._etcd(self.registry.snapshot, "to read the run"), in_process,
            first, self.info.node_id, _now_ms(), cause))  # fmt: skip

    def probe_peers(self, action: policy.ProbePeers) -> policy.PeersProbed:
        dead, unsure = probe_members(self.registry, action.round, self.info.node_id)
        return policy.PeersProbed(action.round, tuple(dead), tuple(unsure),
                                  self._observe(read=False))

    def claim_failure(self, action: policy.ClaimFailure) -> policy.FailureClaimed:
        # Tried again after a reset, a claim that went through reads as another's: the
        # failure then goes uncounted, where raised it ended the node.
        number, what, cause = action.round.number, action.what, action.cause
        claimed = self._etcd(lambda: self.registry.claim_failure(number, what),
                             "to claim a failure")
        repeated = (self._etcd(lambda: report_root_cause(self.registry, cause, claimed=claimed),
                               "to report the root cause") if cause is not None else None)
        return policy.FailureClaimed(claimed, repeated)

    def count_restart(self, action: policy.CountRestart) -> policy.RestartCounted:
        return policy.RestartCounted(self._etcd(self.registry.count_restart,
                                                "to count a restart"))

    def report_root_cause(self, action: policy.ReportRootCause) -> None:
        self._etcd(lambda: report_root_cause(self.registry, action.cause, claimed=False),
                   "to report the root cause")

    def leave_round(self, action: policy.LeaveRound) -> None:
        self.keeper.stop(revoke=True)
        self.events.emit("node.left", round=action.round.number, reason=action.why)

    def reform_without_us(self, action: policy.ReformWithoutUs) -> policy.ReformWritten:
        self.propose(action.proposal)
        return policy.ReformWritten(action.proposal.proposal.round, action.why,
                                    self._etcd(self.registry.current_round, "to read the round"),
                                    _now_ms())

    def announce_leave(self, action: policy.AnnounceLeave) -> None:
        """The workers first (they leave after the step they are in), then the events and
        the run's ``leaving/<node>`` record for ``elastic-rt status``."""
        notice = action.notice
        if action.at_boundary:
            self.workers.tell_to_leave(notice.source)
        round_ = self.state.round
        self.events.emit("node.preempting", round=round_.number if round_ else None,
                         source=notice.source, detail=notice.detail,
                         deadline_ms=action.deadline_ms, notice_deadline_ms=notice.deadline_ms,
                         at_boundary=action.at_boundary)
        logger.warning("node %s leaves %s (%s%s)", self.info.node_id,
                       "after its workers' next step" if action.at_boundary else "now",
                       notice.source, f": {notice.detail}" if notice.detail else "")
        record = {"source": notice.source, "detail": notice.detail, "since_ms": _now_ms(),
                  "deadline_ms": action.deadline_ms, "at_boundary": action.at_boundary}
        if self.keeper.lease_id is None:
            return  # not registered: nothing to show, and a record without a lease would stay
        try:
            self.registry.announce_leaving(self.info.node_id, record, self.keeper.lease_id)
        except StoreError as exc:  # status only: leaving does not depend on it
            logger.warning("could not record the leave in etcd: %s", exc)

    def leave_at_boundary(self, action: policy.LeaveAtBoundary) -> policy.LeaveWritten:
        """Write the round without us and drop our registration, in one transaction."""
        began = time.monotonic()
        try:
            written = self.registry.leave(action.proposal, self.info.node_id)
            current = written or self.registry.current_round()
        except StoreError as exc:
            logger.warning("could not write the round without %s: %s", self.info.node_id, exc)
            written = current = None
        if written is not None:
            self.events.emit(
                "round.formed", round=written.number, world_size=written.world_size,
                members=list(written.members), reason=written.reason,
                duration_ms=int((time.monotonic() - began) * 1000),
            )  # fmt: skip
            logger.info("round %d formed without %s (%s)", written.number, self.info.node_id,
                        written.reason)
        return policy.LeaveWritten(written, current, action.step, time.monotonic(), _now_ms())

    def succeed(self, action: policy.Succeed) -> Exited:
        """Every local worker succeeded: mark the job completing and leave."""
        round_ = action.round
        self._etcd(self.registry.mark_completing, "to mark the job completing")
        self.events.emit("job.finished", round=round_.number if round_ else None)
        self.keeper.stop(revoke=True)
        nodes = self._etcd(self.registry.nodes, "to read the nodes")
        if not [n for n in nodes if round_ and n in round_.members]:
            self.close_run(policy.CloseRun(policy.Finished("finished")))
        logger.info("workers finished; node %s leaves", self.info.node_id)
        return Exited(policy.exit_code(policy.Finished("workers finished")))

    def close_run(self, action: policy.CloseRun) -> None:
        record = policy.closed_record(action.outcome)
        self._etcd(lambda: self.registry.close(record), "to close the run")

    def _etcd(self, call: Callable[[], T], what: str) -> T:
        """One of the hands' etcd calls, tried again through a member's restart for up to
        ``--etcd-wait`` (:func:`agents.etcd_retry.again`)."""
        return again(call, what, within=self.config.rendezvous.etcd_wait.total_seconds(),
                     sleep=self.inbox.sleep)

    def join_timed_out(self, action: policy.JoinTimedOut) -> NoReturn:
        raise self.config.join_timed_out(self.watch.registered())

    def sleep(self, action: policy.Sleep) -> None:
        if action.waiting_for:
            self._report_waiting(action.waiting_for)
        self.inbox.sleep(action.seconds)

    # fencing, leaving, closing -----------------------------------------------------
    def _lease_keeper(self) -> LeaseKeeper:
        # After a fence the loop registers again (policy.StartInStandby, policy.Register),
        # not the keeper.
        return LeaseKeeper(self.registry, self.info, self.config.rendezvous.lease_ttl,
                           on_fenced=self._fence,
                           register=lambda lease: self.watch.join(self.info, lease),
                           rejoin=False)

    def _evict_stale_registration(self) -> None:
        """Our registration from before a restart, still on its old lease: revoke it, so
        the survivors re-form without our lost workers now, not when the lease runs out.
        (The registrations are read only then: a joining node's preview has none.)"""
        if not self.registry.is_registered(self.info.node_id):
            return
        stale = self.registry.nodes().get(self.info.node_id)
        if stale is not None:
            self.registry.evict(stale)

    def revoke_lost_lease(self, action: policy.RevokeLostLease) -> None:
        """After a fence the old lease may still run for a moment: end it, so the survivors
        re-form without this node now rather than when it expires."""
        if self.keeper.lease_id is None:
            return
        try:
            self.kv.revoke_lease(self.keeper.lease_id)
        except StoreError as exc:
            logger.debug("revoking the fenced lease failed: %s", exc)

    def register(self, action: policy.Register) -> policy.Registered | policy.RegisterFailed:
        """Back from a fence in restart mode: register on a new lease (etcd answers again)."""
        keeper = self._lease_keeper()
        try:
            keeper.start()
        except StoreError as exc:
            logger.warning("registering again failed (%s); retrying", exc)
            return policy.RegisterFailed()
        self.keeper = keeper
        return policy.Registered()

    def _fence(self, why: str) -> None:
        """Called from the lease thread: stop training before others declare us dead.

        Stopping the workers is thread-safe and cannot wait; the state is the loop's,
        so the fence reaches it as a note (see :class:`Inbox`).
        """
        self.workers.stop()
        self.events.emit("agent.fenced", reason=why)
        self.inbox.fenced()

    def exit(self, action: policy.Exit) -> Exited:
        """Stop the workers and end the agent with the outcome's exit code."""
        outcome = action.outcome
        if isinstance(outcome, policy.Left):
            return self._leave(outcome)
        exits = self.workers.stop()
        reason = policy.closed_record(outcome)
        if isinstance(outcome, policy.Failed):
            self._report_raised(exits)
            logger.error("job stopped: %s", reason)
        self.events.emit("agent.exited", reason=reason, exitcode=policy.exit_code(outcome))
        return Exited(policy.exit_code(outcome))

    def _leave(self, outcome: policy.Left) -> Exited:
        """Revoke first: peers re-form without waiting out our workers' grace period, and
        a peer whose collective breaks as ours stop finds us unregistered, so it counts a
        membership change, not a failure against the restart budget. After a leave at a
        step boundary the round without us is already written and our workers are
        exiting by themselves."""
        name = signal.Signals(outcome.signum).name if outcome.signum is not None else None
        self.keeper.stop(revoke=True)
        self.workers.stop()
        round_ = self.state.round
        self.events.emit("node.left", round=round_.number if round_ else None, step=outcome.step,
                         signal=name, source=outcome.source or name,
                         at_boundary=outcome.step is not None, why=outcome.why or None)
        logger.info("node %s left (%s)%s%s", self.info.node_id, outcome.source or name,
                    f" after step {outcome.step}" if outcome.step is not None else "",
                    f": {outcome.why}" if outcome.why else "")
        return Exited(policy.exit_code(outcome))

    def _report_raised(self, exits: list[WorkerExit]) -> None:
        """A worker of ours that closed the run (the user's code raised) left its error in
        a file: report it as the root cause, though the closed run, not the worker's exit,
        ended this agent."""
        round_ = self.state.round
        cause = self.workers.raised(round_, exits, self.info.host) if round_ else None
        if cause is None:
            return
        try:
            report_root_cause(self.registry, cause, claimed=False)
        except StoreError as exc:  # leaving anyway: say why here, at least
            logger.warning("root cause not stored (%s):\n%s", exc, cause.table())

    def _report_waiting(self, reason: str) -> None:
        """Show that a long rendezvous wait is alive: one line every 5 s, with its reason,
        and a ``node.waiting`` event each time the reason changes (a spare says it waits as
        one, which ``elastic-rt status`` and tests read)."""
        if reason != self._waiting_for:
            self._waiting_for = reason
            self.events.emit("node.waiting", reason=reason)
        now = time.monotonic()
        if now - self._last_wait_report >= 5.0:
            self._last_wait_report = now
            logger.info("waiting for a round (%s) for %.0f s", reason, now - self._started)


def _now_ms() -> int:
    return int(time.time() * 1000)
