"""The launch agent: one per node. Rendezvous, start and watch workers, recover.

The agent never imports torch (it stays small and starts fast), and decides
nothing itself: each turn of its loop it observes (the run's keys, its workers,
their acknowledgements), asks :func:`agents.policy.decide`, and carries out the
answer: propose a round, agree on its store and start the workers, stop them,
settle a failure (probe the peers, count it against the job's restart budget).

A node that cannot renew its lease stops its workers before the TTL runs out
(self-fencing, from the lease thread) and joins again once etcd answers. SIGTERM
or SIGINT makes a graceful leave: workers stopped, lease revoked, peers re-form.
"""

from __future__ import annotations

import logging
import signal
import time

from agents import policy
from agents.alive import AliveServer, probe_members
from agents.config import AgentConfig
from agents.heartbeat import Heartbeat
from agents.inbox import Inbox
from agents.local_workers import LocalWorkers
from agents.policy import AgentState, Observation
from agents.round_io import agree_on_store, propose_round, report_root_cause, settle_failure
from agents.run_watch import RunWatch
from agents.worker_state import WorkerExit
from elastic_rt.errors import EndpointUnreachableError, StoreConnectionError, StoreError
from elastic_rt.events import EventSink
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import KVStore
from elastic_rt.rendezvous.lease import LeaseKeeper
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import NodeInfo, Round

logger = logging.getLogger(__name__)


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
                                   on_evicted=self.inbox.changed)
        self.state = AgentState()
        self._started = self._last_wait_report = 0.0

    # entry point ---------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends; returns the exit code for the agent process.

        Raises:
            EndpointUnreachableError: etcd did not answer at start.
            RendezvousTimeoutError: too few nodes joined within the join timeout.
        """
        self.inbox.leave_on_signals()
        self._started = time.monotonic()
        self.heartbeat.start()
        try:
            self._join()
            while True:
                code = self._step()
                if code is not None:
                    return code
        finally:
            self.heartbeat.stop()
            self.watch.close()
            self.workers.close()
            self.keeper.stop(revoke=True)
            self.alive.close()
            self.kv.close()

    def _join(self) -> None:
        try:
            snapshot = self.registry.preview()
            if policy.is_stale_run(snapshot):
                self.kv.delete_prefix(self.registry.prefix)
            standby = policy.joins_in_standby(snapshot)
            if standby:
                self._evict_stale_registration()
            if not standby:
                self.keeper.start()
            self.registry.publish_max_restarts(self.config.max_restarts)
        except StoreConnectionError as exc:
            raise EndpointUnreachableError(
                f"cannot reach etcd at {self.config.rendezvous.endpoint} ({exc})",
                "Start etcd there (elastic-rt etcd) or fix --rdzv-endpoint.",
            ) from exc
        self.events.emit("node.joined", host=self.info.host, nproc=self.info.nproc)
        if standby and snapshot.round is not None:
            logger.info("node %s starts its workers before joining run %s", self.info.node_id,
                        self.registry.run_id)
            self._start_in_standby(snapshot.round)
            return
        logger.info("node %s registered for run %s", self.info.node_id, self.registry.run_id)

    # one turn of the loop: observe, decide, act ------------------------------------
    def _step(self) -> int | None:
        if self.inbox.take_fenced():
            self.workers.stop()  # again: the loop may have started workers meanwhile
            self.state = policy.fenced(self.state)
        code = self._carry_out(policy.decide(self.state, self._observe(), self.settings))
        self.heartbeat.watch(self.state.running)  # a hung peer is evicted in under a second
        return code

    def _carry_out(self, decision: policy.Decision) -> int | None:
        self.state = decision.state
        for action in decision.actions:
            code = self._act(action)
            if code is not None:
                return code
        return None

    def _observe(self) -> Observation:
        leave_signal = self.inbox.leave_signal
        snapshot, store_error = (None, False) if leave_signal is not None else (
            self.watch.read(self.state, self.settings))
        workers, exits = self.workers.poll()
        return Observation(
            now=time.monotonic(), now_ms=int(time.time() * 1000), snapshot=snapshot,
            store_error=store_error,
            workers=workers, exits=tuple(exits), acks=self.workers.acks(),
            waited=time.monotonic() - self._started, leave_signal=leave_signal,
        )  # fmt: skip

    def _act(self, action: policy.Action) -> int | None:
        if isinstance(action, policy.Exit):
            return self._exit(action.outcome)
        if isinstance(action, policy.CloseRun):
            self.registry.close(policy.closed_record(action.outcome))
        elif isinstance(action, policy.ProposeRound):
            self._propose(action)
        elif isinstance(action, policy.StartWorkers):
            self._start_round(action.round)
        elif isinstance(action, policy.FollowRound):
            if self._agree_on_store(action.round) is not None:
                self.state = policy.following(self.state, action.round, now=time.monotonic(),
                                              reform_timeout=self.config.reform_timeout)
        elif isinstance(action, policy.StopWorkers):
            self._stop_workers(action.why)
        elif isinstance(action, policy.RejoinInStandby):
            self._revoke_lost_lease()
            self._start_in_standby(action.round, restart=True)
        elif isinstance(action, policy.Register):
            self._register_again()
        elif isinstance(action, policy.HandleFailure):
            return self._workers_failed(action)
        elif isinstance(action, policy.Succeed):
            return self._succeeded(action.round)
        elif isinstance(action, policy.AnswerAlarm):
            return self._answer_alarm(action.round)
        elif isinstance(action, policy.PublishInProcess):
            self.registry.mark_in_process()
        elif isinstance(action, policy.JoinTimedOut):
            raise self.config.join_timed_out(self.watch.registered())
        elif isinstance(action, policy.Sleep):
            if action.waiting_for:
                self._report_waiting(action.waiting_for)
            self.inbox.sleep(action.seconds)
        return None

    # rounds --------------------------------------------------------------------
    def _propose(self, action: policy.ProposeRound) -> None:
        self.inbox.reread()
        propose_round(self.watch.propose, self.events, action)

    def _start_round(self, round_: Round) -> None:
        master = self._agree_on_store(round_)
        if master is None:
            return
        self.state = policy.started(self.state, round_)
        self.workers.start_in(round_, master, self.state.restart_count)

    def _agree_on_store(self, round_: Round) -> tuple[str, int] | None:
        return agree_on_store(self.registry, round_, self.info, wait=self.config.store_wait,
                              sleep=self.inbox.sleep)

    def _answer_alarm(self, round_: Round) -> int | None:
        """A worker's collective failed: evict dead peers, or re-form if all answer."""
        dead, unsure = probe_members(self.registry, round_, self.info.node_id)
        verdict, proposal = policy.alarm_verdict(round_, dead=dead, unsure=unsure,
                                                 workers=self.workers.poll()[0],
                                                 now_ms=int(time.time() * 1000))
        if proposal is not None:
            self._propose(proposal)
        if verdict is policy.AlarmVerdict.HANDLED:
            return None
        return self._carry_out(policy.participate(self.state, round_, self._observe(),
                                                  self.settings))

    # worker outcomes -------------------------------------------------------------
    def _succeeded(self, round_: Round | None) -> int:
        self.registry.mark_completing()
        self.events.emit("job.finished", round=round_.number if round_ else None)
        self.keeper.stop(revoke=True)
        remaining = [n for n in self.registry.nodes() if round_ and n in round_.members]
        if not remaining:
            self.registry.close(policy.closed_record(policy.Finished("finished")))
        logger.info("workers finished; node %s leaves", self.info.node_id)
        return policy.exit_code(policy.Finished("workers finished"))

    def _workers_failed(self, action: policy.HandleFailure) -> int | None:
        first = self.workers.report_failed(action.round, action.exits)
        in_process = self.workers.in_process()
        self._stop_workers("a worker failed")
        progress = self.registry.progress() or {}
        step = progress.get("step")
        cause = self.workers.root_cause(action.round, action.exits, self.info.host,
                                        step if isinstance(step, int) else None)
        verdict = settle_failure(self.registry, action.round, first, cause,
                                 in_process=in_process, settings=self.settings)
        if isinstance(verdict, policy.Failed):
            return self._close(verdict)
        if isinstance(verdict, policy.RestartInStandby):
            self.keeper.stop(revoke=True)
            self.events.emit("node.left", round=verdict.round.number, reason=verdict.why)
            self._start_in_standby(verdict.round, restart=True)
        elif isinstance(verdict, policy.ReplaceWorkers):
            self._reform_without_our_ranks(verdict)
            self._start_in_standby(verdict.proposal.proposal.round, restart=True,
                                   keep_lease=True)
        elif verdict is not None:
            self._propose(verdict)
        return None

    def _reform_without_our_ranks(self, verdict: policy.ReplaceWorkers) -> None:
        """Write the round without our ranks; once more if a peer's alarm wrote a round
        with them meanwhile (its survivors would wait there for our replacements)."""
        self._propose(verdict.proposal)
        current = self.registry.current_round()
        me = self.info.node_id
        if (current is not None and me in current.members
                and current.nprocs[current.group_rank(me)] > 0):
            without = policy.with_ranks(current, me, 0, verdict.why, int(time.time() * 1000))
            self._propose(policy.ProposeRound(without, replaced=current))

    def _start_in_standby(self, round_: Round, *, restart: bool = False,
                          keep_lease: bool = False) -> None:
        """Start workers outside any round; register only once they are imported.

        Used by a node joining a running in-process job, by one replacing a failed
        worker and by one back from a fence. The workers announce themselves once
        imported; only then does the node register (or, with ``keep_lease``, when it
        stayed a member without ranks, ask for its ranks back), and the survivors take
        it in at a step boundary without waiting.
        Workers that do not announce in time are stopped and the node joins the normal
        way (restart mode is the fallback, never a hang).
        """
        first = not self.state.ever_ran
        self.state = policy.standby_started(self.state, restart=restart)
        self.workers.start_standby(self.state.restart_count, first=first)
        self.workers.wait_announced(self.config.reform_timeout.total_seconds(),
                                    give_up=lambda: self.inbox.leave_signal is not None,
                                    sleep=self.inbox.sleep)
        if not keep_lease:
            self.keeper = self._lease_keeper()
            self.keeper.start()
            self.state = policy.registered(self.state)
        if self.workers.in_process():
            # Belong to no round yet: the round that admits us (even the current one, if it
            # still lists us) then starts through FollowRound and gets its store published.
            self.state = policy.in_standby(self.state, round_)
        else:
            self._stop_workers("standby workers did not start in time")

    def _stop_workers(self, why: str) -> None:
        self.workers.stop(why)
        self.state = policy.stopped(self.state)

    # fencing, leaving, closing -----------------------------------------------------
    def _lease_keeper(self) -> LeaseKeeper:
        # After a fence the loop registers again (see policy.RejoinInStandby), not the keeper.
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

    def _revoke_lost_lease(self) -> None:
        """After a fence the old lease may still run for a moment: end it, so the survivors
        re-form without this node now rather than when it expires."""
        if self.keeper.lease_id is None:
            return
        try:
            self.kv.revoke_lease(self.keeper.lease_id)
        except StoreError as exc:
            logger.debug("revoking the fenced lease failed: %s", exc)

    def _register_again(self) -> None:
        """Back from a fence in restart mode: register on a new lease (etcd answers again)."""
        keeper = self._lease_keeper()
        try:
            keeper.start()
        except StoreError as exc:
            logger.warning("registering again failed (%s); retrying", exc)
            self.inbox.sleep(self.settings.retry_after.total_seconds())
            return
        self.keeper = keeper
        self.state = policy.registered(self.state)

    def _fence(self, why: str) -> None:
        """Called from the lease thread: stop training before others declare us dead.

        Stopping the workers is thread-safe and cannot wait; the state is the loop's,
        so the fence reaches it as a note (see :class:`Inbox`).
        """
        self.workers.stop()
        self.events.emit("agent.fenced", reason=why)
        self.inbox.fenced()

    def _exit(self, outcome: policy.Outcome) -> int:
        if isinstance(outcome, policy.Left):
            name = signal.Signals(outcome.signum).name
            # Revoke first: peers re-form without waiting out our workers' grace period,
            # and a peer whose collective breaks as ours stop finds us unregistered, so
            # it counts a membership change, not a failure against the restart budget.
            self.keeper.stop(revoke=True)
            self.workers.stop()
            self.events.emit("node.left", signal=name)
            logger.info("node %s left on %s", self.info.node_id, name)
            return policy.exit_code(outcome)
        exits = self.workers.stop()
        reason = policy.closed_record(outcome)
        if isinstance(outcome, policy.Failed):
            self._report_raised(exits)
            logger.error("job stopped: %s", reason)
        self.events.emit("agent.exited", reason=reason, exitcode=policy.exit_code(outcome))
        return policy.exit_code(outcome)

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

    def _close(self, outcome: policy.Failed) -> int:
        """Close the run for everyone, and leave saying why, like the peers will."""
        self.registry.close(policy.closed_record(outcome))
        return self._exit(outcome)

    def _report_waiting(self, reason: str) -> None:
        """Show that a long rendezvous wait is alive: one line every 5 s, with its reason."""
        now = time.monotonic()
        if now - self._last_wait_report >= 5.0:
            self._last_wait_report = now
            logger.info("waiting for a round (%s) for %.0f s", reason, now - self._started)
