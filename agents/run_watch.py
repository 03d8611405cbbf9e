"""A node's copy of its run: joined with one transaction, kept current by one watch.

Reading the whole run at each decision cost every node O(N) per read and the job
O(N^2) per round, and every node raced to write each round (issue 15). Here a node
joins with :meth:`RunRegistry.join` (register, take the leadership if free, read)
and watches from the revision that read: the leader the whole run, a follower only
the ``round`` keys (election.py). Decisions read the copy, not etcd; the run is
read again only when the copy cannot be trusted:

- the watch broke (etcd restarted, a cluster member died, history compacted): one
  claim transaction re-reads, and the watch starts again after it;
- the leader key went (the leader's lease ended): one claim transaction, which one
  follower wins and reads the whole run in;
- the job is completing: a follower reads the registrations once per decision,
  because :func:`agents.policy.finished_without_us` needs to know who is left.

Shared by the agent (agents/agent.py) and the simulated nodes (agents/simulated.py,
agents/swarm.py), so the benchmark counts the calls an agent makes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from agents import policy
from agents.inbox import Inbox
from elastic_rt.errors import StoreError
from elastic_rt.rendezvous.election import RunView
from elastic_rt.rendezvous.kv import Change, KeyValue
from elastic_rt.rendezvous.registry import ROUND, Joined, RunRegistry
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
        self._view: RunView | None = None
        self._generation = 0
        """Bumped by each new view, so a cancelled watch's late events are dropped."""
        self._cancel: Callable[[], None] | None = None
        self._resync = False
        self._superseded: int | None = None
        """The round token a lost proposal expected: the next decision waits until the
        view holds another round (the winner's), unless it already does."""
        self._node_id = ""
        self._lease = 0
        self._last_read = 0.0

    @property
    def is_leader(self) -> bool:
        with self._lock:
            return self._view is not None and self._view.leader

    @property
    def is_current(self) -> bool:
        """The next :meth:`read` needs no etcd call and no wait (the common case).

        How a caller that multiplexes many nodes on one event loop (agents/swarm.py)
        knows it may read on the loop rather than queue the read for a thread.
        """
        with self._lock:
            view = self._view
            return (view is not None and not self._resync and not self._waits_for_winner(view)
                    and not (view.leader_gone and not view.leader)
                    and not (view.snapshot().completing and not view.leader))

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
        view = RunView(self.registry.prefix, joined)
        with self._lock:
            self._generation += 1
            generation, self._view = self._generation, view
            stale, self._cancel = self._cancel, None
            self._resync = False
        if stale is not None:
            stale()

        def changed(changes: list[Change] | None) -> None:  # from the watch's thread
            with self._lock:
                if generation != self._generation:
                    return
                if changes is None:
                    self._resync = True  # the stream broke: events may be lost
                else:
                    view.apply(changes)
                self._lock.notify_all()
            self._tell()

        try:
            cancel = self.registry.kv.watch_changes(view.watch_prefix, changed,
                                                    start_revision=joined.revision + 1)
        except StoreError as exc:
            logger.warning("watch on run %s not armed (%s); reading it again",
                           self.registry.run_id, exc)
            with self._lock:
                if generation == self._generation:
                    self._resync = True
            self._tell()
            return
        with self._lock:
            if generation == self._generation:
                self._cancel, cancel = cancel, lambda: None
        cancel()  # a newer view replaced this one meanwhile
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
        since = time.monotonic() - self._last_read
        if not policy.should_read(state, dirty=self.inbox.dirty, since_read=since,
                                  settings=settings):
            return None, False
        self.inbox.mark_read()
        try:
            snapshot = self._current(settings.retry_after.total_seconds())
        except StoreError as exc:
            logger.warning("etcd unavailable (%s)", exc)
            return None, True
        self._last_read = time.monotonic()
        return snapshot, False

    def _current(self, patience: float) -> Snapshot:
        with self._lock:
            self._lock.wait_for(lambda: self._view is not None
                                and not self._waits_for_winner(self._view), patience)
            self._superseded = None
            view, resync = self._view, self._resync
        assert view is not None, "the run is read before the node joined it"
        if resync or (view.leader_gone and not view.leader):
            joined = self.registry.claim_leadership(self._node_id, self._lease,
                                                    held=view.leader_revision if view.leader
                                                    else 0)
            if joined.leader or resync:
                self._follow(joined)
            else:
                with self._lock:
                    view.merge(joined)
        with self._lock:
            assert self._view is not None
            snapshot = self._view.snapshot()
        if snapshot.completing and not snapshot.nodes_known:
            return self.registry.snapshot()
        return snapshot

    def registered(self) -> int | None:
        """How many nodes are registered; None if etcd does not answer.

        A follower does not hold the registrations, so it reads them: only for the
        message of a join that timed out.
        """
        with self._lock:
            view = self._view
            if view is not None and view.leader:
                return len(view.snapshot().nodes)
        try:
            return len(self.registry.nodes())
        except StoreError:
            return None

    # writing -----------------------------------------------------------------------------
    def propose(self, proposal: Propose) -> Round | None:
        """Write the proposed round (None: another won), and hold the outcome at once.

        A node deciding again on a copy without the round just written would propose
        again; so a won round goes into the copy now, and after a lost one the next
        read waits (up to ``retry_after``) for the watch to bring the winner's, unless
        the copy holds it already (then no wait: the loser decides at once).
        """
        written = self.registry.propose(proposal)
        with self._lock:
            if written is None:
                self._superseded = proposal.expected_token
            elif self._view is not None:
                item = KeyValue(self.registry.key(ROUND), written.to_json(), written.token,
                                written.token, 0)
                self._view.apply([Change(item, deleted=False)])
        return written

    def _waits_for_winner(self, view: RunView) -> bool:
        return self._superseded is not None and view.round_token == self._superseded

    def close(self) -> None:
        with self._lock:
            self._generation += 1
            cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()
