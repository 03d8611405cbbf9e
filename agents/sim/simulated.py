"""Rendezvous participants without workers, running the agent's own decisions.

A :class:`SimulatedNode` registers on a real lease
(:class:`~elastic_rt.rendezvous.lease.LeaseKeeper`), follows the run through the
agent's own :class:`~agents.run_watch.RunWatch` and runs :func:`agents.policy.decide`
through the agent's own dispatcher (:mod:`agents.dispatch`) on a thread, exactly as an
agent does, with no workers: starting them only records the round. Dozens fit in one
process, which is how the integration tests put many nodes on one etcd
(agents/sim/swarm.py holds a thousand for the benchmark).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, NoReturn

from agents import policy
from agents.inbox import Inbox
from agents.dispatch import Driver, Exited, carry_out
from agents.policy import AgentState, Observation
from agents.run_watch import RunWatch
from agents.sim.counting import CountingKV, OpCounter
from agents.sim.workerless import Workerless
from elastic_rt.config import DEFAULT_LEASE_TTL
from elastic_rt.errors import RendezvousTimeoutError, StoreError
from elastic_rt.rendezvous import rounds
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import KVStore
from elastic_rt.rendezvous.lease import LeaseKeeper
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import Limits, NodeInfo, Round

logger = logging.getLogger(__name__)


class SimulatedNode(Workerless):
    """One rendezvous participant on a thread: registration, lease, decisions, no workers.

    Args:
        kv: this node's store client (give each node its own, as real nodes have).
        run_id: the run to join.
        node_id: unique within the run.
        limits: ``--nnodes MIN:MAX`` and the last-call window.
        ttl: lease time-to-live.
        nproc: workers this node would run (only recorded in the round).
        wait_poll: seconds between snapshots while waiting (the agent's 0.5 s).
        member_poll: seconds between snapshots while in a round (the agent re-reads
            at most once a second and looks at its workers every monitor interval).
    """

    def __init__(
        self,
        kv: KVStore,
        run_id: str,
        node_id: str,
        limits: Limits,
        *,
        ttl: timedelta = DEFAULT_LEASE_TTL,
        nproc: int = 1,
        wait_poll: float = 0.5,
        member_poll: float = 0.1,
    ) -> None:
        self.kv = kv
        self.registry = RunRegistry(kv, run_id)
        self.info = NodeInfo(node_id=node_id, host="127.0.0.1", nproc=nproc)
        self.node_id = node_id
        self.settings = simulated_settings(node_id, limits, wait_poll=wait_poll,
                                           member_poll=member_poll)
        self.inbox = Inbox()
        self.watch = RunWatch(self.registry, self.inbox)
        self.keeper = LeaseKeeper(self.registry, self.info, ttl, on_fenced=self._on_fenced,
                                  register=lambda lease: self.watch.join(self.info, lease))
        self.driver = Driver(self.settings)
        self.rounds: list[Round] = []
        """Every round this node took part in, in order (one entry per round number)."""
        self.proposed: list[Round] = []
        """Rounds this node wrote (it won the compare)."""
        self.error: BaseException | None = None
        self.fenced: list[str] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sim-{node_id}", daemon=True)

    # lifecycle ---------------------------------------------------------------------
    def start(self) -> "SimulatedNode":
        """Register and loop on the node's thread; returns at once."""
        self._thread.start()
        return self

    def halt(self) -> None:
        """Stop deciding (the lease is still kept): lets many nodes quiet down at once."""
        self._stop.set()
        self.inbox.changed()

    def stop(self, *, revoke: bool = True) -> None:
        """Leave: with ``revoke`` the registration goes now, else when the lease expires."""
        self.halt()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.keeper.stop(revoke=revoke)

    def crash(self) -> None:
        """Die silently: no more renewals and no revoke, so the lease runs out."""
        self.stop(revoke=False)

    # observation -------------------------------------------------------------------
    @property
    def state(self) -> AgentState:
        return self.driver.state

    @property
    def last_action(self) -> rounds.Action | None:
        """The last round decision (Wait, Participate, ...) the node acted on."""
        return self.driver.rendezvous

    @property
    def current(self) -> Round | None:
        with self._changed:
            return self.rounds[-1] if self.rounds else None

    def wait_for_round(self, predicate: Callable[[Round], bool], timeout: float) -> Round:
        """Block until this node took part in a round that satisfies ``predicate``.

        Raises:
            TimeoutError: no such round within ``timeout`` seconds (or the loop died).
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for round_ in reversed(self.rounds):
                    if predicate(round_):
                        return round_
                left = deadline - time.monotonic()
                if left <= 0 or self.error is not None:
                    raise TimeoutError(
                        f"{self.node_id}: no matching round within {timeout:.1f} s; "
                        f"saw {[(r.number, r.members) for r in self.rounds]}, "
                        f"last action {self.last_action}, error {self.error!r}"
                    )
                self._changed.wait(min(left, 0.5))

    # the loop: the agent's decisions, carried out without workers ----------------------
    def _run(self) -> None:
        try:
            self.keeper.start()
            while not self._stop.is_set():
                self._step()
        except BaseException as exc:  # noqa: BLE001 - thread boundary: keep it for the test
            logger.exception("simulated node %s died", self.node_id)
            with self._changed:
                self.error = exc
                self._changed.notify_all()
        finally:
            self.watch.close()

    def _step(self) -> None:
        if self.inbox.take_fenced():
            carry_out(self, self.driver, policy.Fenced())
        carry_out(self, self.driver, self._observe())

    def _observe(self) -> Observation:
        snapshot, store_error = self.watch.read(self.state, self.settings)
        return Observation(now=time.monotonic(), now_ms=int(time.time() * 1000),
                           snapshot=snapshot, store_error=store_error)

    # the hands (agents.dispatch): the agent's, without workers -------------------------
    def propose(self, action: policy.ProposeRound) -> None:
        self.inbox.reread()
        try:
            written = self.watch.propose(action.proposal)
        except StoreError as exc:
            logger.debug("%s: proposal failed: %s", self.node_id, exc)
            return
        if written is not None:
            with self._changed:
                self.proposed.append(written)

    def start_workers(self, action: policy.StartWorkers) -> policy.WorkersStarted:
        """Starting workers only records the round."""
        self._record(action.round)
        return policy.WorkersStarted(action.round)

    def follow_round(self, action: policy.FollowRound) -> policy.RoundFollowed:
        self._record(action.round)
        return policy.RoundFollowed(action.round, now=time.monotonic())

    def stop_workers(self, action: policy.StopWorkers) -> None:
        pass

    def register(self, action: policy.Register) -> policy.Registered:
        return policy.Registered()  # the node's lease keeper registers again by itself

    def close_run(self, action: policy.CloseRun) -> None:
        self.registry.close(policy.closed_record(action.outcome))

    def exit(self, action: policy.Exit) -> Exited:
        self._stop.set()
        return Exited(policy.exit_code(action.outcome))

    def join_timed_out(self, action: policy.JoinTimedOut) -> NoReturn:
        raise RendezvousTimeoutError(f"only {action.registered} nodes joined",
                                     "Start more simulated nodes.")

    def sleep(self, action: policy.Sleep) -> None:
        self.inbox.sleep(action.seconds)

    def _record(self, round_: Round) -> None:
        with self._changed:
            if not self.rounds or self.rounds[-1].number != round_.number:
                self.rounds.append(round_)
                self._changed.notify_all()

    def _on_fenced(self, why: str) -> None:
        self.fenced.append(why)
        self.inbox.fenced()


def simulated_settings(node_id: str, limits: Limits, *, wait_poll: float,
                       member_poll: float) -> policy.Settings:
    """The policy's settings for a node without workers: it polls its membership every
    ``member_poll`` seconds and waits ``wait_poll`` between rendezvous attempts."""
    return policy.Settings(
        node_id=node_id, limits=limits, monitor_interval=timedelta(seconds=member_poll),
        wait_poll=timedelta(seconds=wait_poll), reread_every=timedelta(seconds=member_poll),
        retry_after=timedelta(seconds=wait_poll),
    )  # fmt: skip


def start_nodes(
    endpoint: str,
    run_id: str,
    names: Iterable[str],
    limits: Limits,
    *,
    counter: OpCounter | None = None,
    **node_kwargs: object,
) -> list[SimulatedNode]:
    """Build one client per node (counted when ``counter`` is given) and start them."""
    nodes = []
    for name in names:
        kv: KVStore = EtcdKV(endpoint)
        if counter is not None:
            kv = CountingKV(kv, counter)
        node = SimulatedNode(kv, run_id, name, limits, **node_kwargs)  # type: ignore[arg-type]
        nodes.append(node)
    for node in nodes:
        node.start()
    return nodes


def stop_nodes(nodes: Iterable[SimulatedNode], *, revoke: bool = True) -> None:
    """Halt every loop first, so one node's leave does not wake all the others."""
    nodes = list(nodes)
    for node in nodes:
        node.halt()
    for node in nodes:
        node.stop(revoke=revoke)
        node.kv.close()
