"""A node's copy of its run: joined with one transaction, kept current by one watch.

Decisions read the copy, never etcd, and only the elected leader writes rounds: a
round of 1024 nodes forms in 0.64-0.87 s on one local etcd at 3.00 etcd calls per
node (docs/rendezvous.md). Reading the whole run at each decision, every node racing
to write, had cost 38 calls per node and 68.7 s at 256.

A node joins with :meth:`RunRegistry.join` (register, take the leadership if free,
read) and watches from the revision that read: the leader the whole run, a follower
only the ``round`` keys (election.py). The run is read again only when the copy
cannot be trusted:

- the watch broke (etcd restarted, a cluster member died, history compacted): one
  claim transaction re-reads, and the watch starts again after it;
- the leader key went (the leader's lease ended): one claim transaction, which one
  follower wins and reads the whole run in;
- the job is completing: a follower reads the registrations once per decision,
  because :func:`agents.policy.finished_without_us` needs to know who is left.

Shared by the agent (agents/agent.py) and the simulated nodes (agents/sim/simulated.py).
What the copy decides is :class:`agents.run_copy.RunCopy`, without IO; this class
makes its etcd calls, blocking. The swarm simulator (agents/sim/swarm.py) drives the same
:class:`~agents.run_copy.RunCopy` and the same registry requests over asyncio
(agents/sim/run_watch_aio.py), so the benchmark counts the calls an agent makes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from agents import policy
from agents.inbox import Inbox
from agents.run_copy import RunCopy, needs_registrations, read_is_due
from elastic_rt.errors import StoreError
from elastic_rt.rendezvous.kv import Change
from elastic_rt.rendezvous.registry import Joined, RunRegistry
from elastic_rt.rendezvous.rounds import NodeInfo, Propose, Round, Snapshot

logger = logging.getLogger(__name__)


class RunWatch:
    """The run as one node follows it.

    Args:
        registry: the run's keys.
        inbox: told when the run changed (the agent's loop wakes on it).
        on_change: also called on each change, from the watch's thread.
    """

    def __init__(self, registry: RunRegistry, inbox: Inbox,
                 on_change: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.inbox = inbox
        self._on_change = on_change
        self._lock = threading.Condition()
        """Guards :attr:`_copy`: watch events arrive on the client's thread."""
        self._copy = RunCopy(registry.prefix)
        self._node_id = ""
        self._lease = 0
        self._last_read = 0.0

    @property
    def is_leader(self) -> bool:
        with self._lock:
            return self._copy.is_leader

    @property
    def is_current(self) -> bool:
        """The next :meth:`read` needs no etcd call and no wait (the common case)."""
        with self._lock:
            return self._copy.is_current

    # joining ---------------------------------------------------------------------------
    def join(self, info: NodeInfo, lease: int) -> None:
        """Register ``info`` on ``lease`` and follow the run from there (each new lease).

        Raises:
            StoreError: etcd did not answer the join.
        """
        joined = self.registry.join(info, lease)
        self._node_id, self._lease = info.node_id, lease
        self._follow(joined)

    def _follow(self, joined: Joined) -> None:
        """Hold the run as ``joined`` read it, and watch every change after that."""
        with self._lock:
            wanted, stale = self._copy.follow(joined)
        if stale is not None:
            stale()

        def changed(changes: list[Change] | None) -> None:  # from the watch's thread
            with self._lock:
                current = self._copy.changed(wanted.generation, changes)
                self._lock.notify_all()
            if current:
                self._tell()

        try:
            cancel = self.registry.kv.watch_changes(wanted.prefix, changed,
                                                    start_revision=wanted.start_revision)
        except StoreError as exc:
            logger.warning("watch on run %s not armed (%s); reading it again",
                           self.registry.run_id, exc)
            with self._lock:
                self._copy.arm_failed(wanted.generation)
            self._tell()
            return
        with self._lock:
            late = self._copy.armed(wanted.generation, cancel)
        if late is not None:
            late()  # a newer view replaced this one meanwhile
        self._tell()

    def _tell(self) -> None:
        self.inbox.changed()
        if self._on_change is not None:
            self._on_change()

    # reading -----------------------------------------------------------------------------
    def read(self, state: policy.AgentState, settings: policy.Settings
             ) -> tuple[Snapshot | None, bool]:
        """(the snapshot, or None when no decision needs it, whether etcd failed to answer).

        See :func:`agents.policy.should_read`: a node in a round that heard of no
        change decides on what it holds.
        """
        if not read_is_due(self.inbox, state, settings, self._last_read):
            return None, False
        try:
            snapshot = self._current(settings.retry_after.total_seconds())
        except StoreError as exc:
            logger.warning("etcd unavailable (%s)", exc)
            return None, True
        self._last_read = time.monotonic()
        return snapshot, False

    def _current(self, patience: float) -> Snapshot:
        with self._lock:
            self._lock.wait_for(lambda: self._copy.ready, patience)
            refresh = self._copy.refresh()
        if refresh is not None:
            joined = self.registry.claim_leadership(self._node_id, self._lease,
                                                    held=refresh.held)
            with self._lock:
                follow = self._copy.claimed(refresh, joined)
            if follow:
                self._follow(joined)
        with self._lock:
            snapshot = self._copy.snapshot()
        if needs_registrations(snapshot):
            return self.registry.snapshot()
        return snapshot

    def registered(self) -> int | None:
        """How many nodes are registered; None if etcd does not answer.

        A follower does not hold the registrations, so it reads them: only for the
        message of a join that timed out.
        """
        with self._lock:
            held = self._copy.registered()
        if held is not None:
            return held
        try:
            return len(self.registry.nodes())
        except StoreError:
            return None

    # writing -----------------------------------------------------------------------------
    def propose(self, proposal: Propose) -> Round | None:
        """Write the proposed round (None: another won), and hold the outcome at once
        (see :meth:`agents.run_copy.RunCopy.proposed`)."""
        written = self.registry.propose(proposal)
        with self._lock:
            self._copy.proposed(proposal, written)
        return written

    def close(self) -> None:
        with self._lock:
            cancel = self._copy.close()
        if cancel is not None:
            cancel()
