"""What a node's copy of its run decides, without the IO (the sans-IO core of RunWatch).

Every decision about the copy is here and every etcd call is a driver's, so the
blocking agent and the asyncio swarm run the same code: a thousand simulated nodes
cost the harness ~0.7 ms of CPU each to join (docs/rendezvous.md), and what they
send is what an agent sends.

A node follows its run with one join transaction and one watch (agents/run_watch.py
says why). The decisions about that copy, which view is current, which watch's
events still count, when a read must ask etcd first (a broken watch, a vanished
leader), what a claim's answer changes and what a proposal leaves behind, are here,
as plain methods on plain data. The calls to etcd are the drivers': the agent's
:class:`agents.run_watch.RunWatch` makes them blocking on its own client, and the
swarm simulator's :class:`agents.sim.run_watch_aio.AioRunWatch` makes the same ones on
an asyncio client, without a thread per node.

Not thread-safe: a driver whose watch events arrive on another thread holds a lock
around every call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from agents import policy
from agents.inbox import Inbox
from elastic_rt.rendezvous.election import RunView
from elastic_rt.rendezvous.kv import Change, KeyValue
from elastic_rt.rendezvous.registry import ROUND, Joined
from elastic_rt.rendezvous.rounds import Propose, Round, Snapshot

Cancel = Callable[[], None]


@dataclass(frozen=True)
class WatchFrom:
    """The watch a new view needs: on ``prefix`` from ``start_revision``."""

    generation: int
    """Which view it feeds; events for an older one are dropped."""
    prefix: str
    start_revision: int


@dataclass(frozen=True)
class Refresh:
    """The copy cannot be trusted as it is: send one claim transaction first."""

    view: RunView
    held: int
    """The leader key's revision, when this node holds it (its claim compares it)."""
    resync: bool
    """The watch broke: whatever the claim says, follow from its answer."""


class RunCopy:
    """The run as one node holds it, and what its next etcd call must be.

    Args:
        prefix: the run's key prefix (``/elastic_rt/<run_id>/``).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._view: RunView | None = None
        self._generation = 0
        """Bumped by each new view, so a cancelled watch's late events are dropped."""
        self._cancel: Cancel | None = None
        self._resync = False
        self._superseded: int | None = None
        """The round token a lost proposal expected: the next read waits until the
        view holds another round (the winner's), unless it already does."""

    # following ---------------------------------------------------------------------
    def follow(self, joined: Joined) -> tuple[WatchFrom, Cancel | None]:
        """Hold the run as ``joined`` read it; (the watch to arm, the stale one to cancel)."""
        view = RunView(self.prefix, joined)
        self._generation += 1
        self._view = view
        stale, self._cancel = self._cancel, None
        self._resync = False
        return WatchFrom(self._generation, view.watch_prefix, joined.revision + 1), stale

    def changed(self, generation: int, changes: list[Change] | None) -> bool:
        """A watch event (None: the stream broke); False when it is for a replaced view."""
        if generation != self._generation or self._view is None:
            return False
        if changes is None:
            self._resync = True  # events may be lost: read again
        else:
            self._view.apply(changes)
        return True

    def armed(self, generation: int, cancel: Cancel) -> Cancel | None:
        """The watch for ``generation`` is set up; returns it to cancel at once when a
        newer view replaced that one meanwhile."""
        if generation == self._generation:
            self._cancel = cancel
            return None
        return cancel

    def arm_failed(self, generation: int) -> None:
        """etcd did not set up the watch: the next read reads the run again."""
        if generation == self._generation:
            self._resync = True

    def close(self) -> Cancel | None:
        """Drop the view's watch (returned, for the driver to cancel)."""
        self._generation += 1
        cancel, self._cancel = self._cancel, None
        return cancel

    # reading ---------------------------------------------------------------------------
    @property
    def joined(self) -> bool:
        return self._view is not None

    @property
    def is_leader(self) -> bool:
        return self._view is not None and self._view.leader

    @property
    def ready(self) -> bool:
        """A read may go ahead: joined, and not waiting for a winner's round."""
        return self._view is not None and not self._waits_for_winner(self._view)

    @property
    def is_current(self) -> bool:
        """The next read needs no etcd call and no wait (the common case)."""
        view = self._view
        return (view is not None and not self._resync and not self._waits_for_winner(view)
                and not (view.leader_gone and not view.leader)
                and not (view.snapshot().completing and not view.leader))

    def refresh(self) -> Refresh | None:
        """At a read (once :attr:`ready`, or its patience ran out): the claim to send
        first, or None when the copy is current."""
        self._superseded = None
        view = self._view
        assert view is not None, "the run is read before the node joined it"
        if self._resync or (view.leader_gone and not view.leader):
            return Refresh(view, view.leader_revision if view.leader else 0, self._resync)
        return None

    def claimed(self, refresh: Refresh, joined: Joined) -> bool:
        """The claim's answer: True when the driver must :meth:`follow` it (this node
        took the leadership, or the watch broke); else its newer values are merged."""
        if joined.leader or refresh.resync:
            return True
        refresh.view.merge(joined)
        return False

    def snapshot(self) -> Snapshot:
        """The run as held. When it says :func:`needs_registrations`, the driver reads
        the whole run instead (a follower deciding whether the job finished without it)."""
        assert self._view is not None, "the run is read before the node joined it"
        return self._view.snapshot()

    def registered(self) -> int | None:
        """How many nodes are registered, if this node knows (a leader does)."""
        view = self._view
        return len(view.snapshot().nodes) if view is not None and view.leader else None

    # writing -----------------------------------------------------------------------------
    def proposed(self, proposal: Propose, written: Round | None) -> None:
        """Hold a proposal's outcome at once.

        A node deciding again on a copy without the round just written would propose
        again; so a won round goes into the copy now, and after a lost one the next
        read waits (up to ``retry_after``) for the watch to bring the winner's, unless
        the copy holds it already (then no wait: the loser decides at once).
        """
        if written is None:
            self._superseded = proposal.expected_token
        elif self._view is not None:
            item = KeyValue(self.prefix + ROUND, written.to_json(), written.token,
                            written.token, 0)
            self._view.apply([Change(item, deleted=False)])

    def _waits_for_winner(self, view: RunView) -> bool:
        return self._superseded is not None and view.round_token == self._superseded


def needs_registrations(snapshot: Snapshot) -> bool:
    """A follower's copy of a completing job: the decision needs who is registered."""
    return snapshot.completing and not snapshot.nodes_known


def read_is_due(inbox: Inbox, state: policy.AgentState, settings: policy.Settings,
                last_read: float) -> bool:
    """Whether a decision needs the run read now (``last_read``: monotonic time of the last
    read); if so the inbox's news counts as read. Both drivers (``RunWatch``,
    ``AioRunWatch``) gate their reads on it, see :func:`agents.policy.should_read`."""
    if not policy.should_read(state, dirty=inbox.dirty, since_read=time.monotonic() - last_read,
                              settings=settings):
        return False
    inbox.mark_read()
    return True
