"""A swarm node on the elected protocol (elastic_rt/rendezvous/election.py).

It differs from :class:`agents.swarm.SwarmNode` only in how it learns the run: one
join transaction (register, claim the leadership if free, read), then a watch whose
events carry the keys, kept in a :class:`~elastic_rt.rendezvous.election.RunView`.
Its decisions are the agent's own (:func:`agents.policy.decide`) over the view's
snapshot, so a follower reads nothing after joining and only the leader proposes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from agents import policy
from agents.swarm import SwarmNode
from elastic_rt.errors import StoreError
from elastic_rt.rendezvous.election import RunView
from elastic_rt.rendezvous.kv import Change
from elastic_rt.rendezvous.registry import Joined
from elastic_rt.rendezvous.rounds import Snapshot


class ElectedSwarmNode(SwarmNode):
    """A :class:`SwarmNode` that joins with one transaction and learns the run by watch."""

    view: RunView | None = None
    _resync = False
    _cancel_watch: Callable[[], None] | None = None
    _behind = 0
    """A revision the view must reach before deciding again (after this node's write)."""

    async def _join(self) -> None:
        await self._register()

    async def _register(self) -> None:
        self.lease = await self.swarm.call(self.kv.grant_lease, max(1, int(self.ttl.seconds)))
        await self._follow(await self.swarm.call(self.registry.join, self.info, self.lease))
        self.swarm.keep(self.lease, self._lease_lost)

    async def _follow(self, joined: Joined) -> None:
        """Hold the run as ``joined`` read it and watch every change after that."""
        if self._cancel_watch is not None:
            self._cancel_watch()
        view = self.view = RunView(self.registry.prefix, joined)
        loop = asyncio.get_running_loop()

        def changed(changes: list[Change] | None) -> None:  # from a client's watch thread
            loop.call_soon_threadsafe(self._changed, changes)

        def arm() -> Callable[[], None]:  # waits for etcd's answer: not on the event loop
            return self.kv.watch_changes(view.watch_prefix, changed,
                                         start_revision=joined.revision + 1)

        self._cancel_watch = await self.swarm.call(arm)
        self._cancels = [self._cancel_watch]
        self._wake.set()

    def _changed(self, changes: list[Change] | None) -> None:
        if changes is None:
            self._resync = True  # the stream broke: events may be lost
        elif self.view is not None:
            self.view.apply(changes)
        self._wake.set()

    async def _act(self, action: policy.Action) -> None:
        before = self.view.revision if self.view is not None else 0
        await super()._act(action)
        if isinstance(action, policy.ProposeRound):
            # Deciding again on a view without our own write would propose again; the
            # round key changed either way (our write or the winner's), so wait for it.
            self._behind = before + 1

    async def _observe(self) -> tuple[Snapshot | None, bool]:
        assert self.view is not None
        deadline = time.monotonic() + self.settings.retry_after.total_seconds()
        while self.view.revision < self._behind and time.monotonic() < deadline:
            try:  # bounded: without the event, decide on what is held
                await asyncio.wait_for(self._wake.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
            self._wake.clear()
        self._behind = 0
        try:
            if self._resync or (self.view.leader_gone and not self.view.leader):
                joined = await self.swarm.call(self.registry.claim_leadership, self.node_id,
                                               self.lease)
                if joined.leader or self._resync:
                    self._resync = False
                    await self._follow(joined)
                else:
                    self.view.merge(joined)
        except StoreError:
            return None, True
        return self.view.snapshot(), False
