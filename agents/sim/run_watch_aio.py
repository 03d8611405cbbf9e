"""The agent's RunWatch over asyncio: how a swarm's simulated node follows its run.

A swarm node sends the agent's etcd calls, step for step, without a thread per call:
with threads, joining cost ~4.6 ms of harness CPU per node and starved etcd at 1024
nodes; on the event loop it costs ~0.7 ms (docs/rendezvous.md).
:class:`agents.run_watch.RunWatch` makes the calls blocking, one node per process as
the agent is; a swarm holds hundreds of nodes per process (agents/sim/swarm.py). This
driver makes the same calls on an
:class:`~agents.sim.etcd_aio.AioEtcdKV` from the node's event loop. Both
drivers send the registry's own requests (:meth:`RunRequests.join_request`,
:meth:`~RunRequests.claim_request`, :meth:`~RunRequests.propose_request`) and leave
every decision about the copy to the same :class:`~agents.run_copy.RunCopy`; what
is here is only when to call etcd and with what, step for step as in RunWatch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from agents import policy
from agents.inbox import Inbox
from agents.run_copy import Cancel, RunCopy, needs_registrations, read_is_due
from agents.sim.etcd_aio import AioEtcdKV
from elastic_rt.errors import StoreError
from elastic_rt.rendezvous.kv import Change
from elastic_rt.rendezvous.registry import Joined, RunRequests, snapshot_from
from elastic_rt.rendezvous.rounds import NodeInfo, Propose, Round, Snapshot

logger = logging.getLogger(__name__)


class AioRunWatch:
    """The run as one node follows it, on an event loop.

    Args:
        registry: the run's keys and the requests on them.
        kv: the asyncio client the calls go through.
        inbox: told when the run changed.
        on_change: also called on each change, on the event loop.
    """

    def __init__(self, registry: RunRequests, kv: AioEtcdKV, inbox: Inbox,
                 on_change: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.kv = kv
        self.inbox = inbox
        self._on_change = on_change
        self._copy = RunCopy(registry.prefix)
        self._changed = asyncio.Event()
        self._node_id = ""
        self._lease = 0
        self._last_read = 0.0

    @property
    def is_leader(self) -> bool:
        return self._copy.is_leader

    # joining ---------------------------------------------------------------------------
    async def join(self, info: NodeInfo, lease: int) -> None:
        """As :meth:`RunWatch.join`: one transaction, then one watch."""
        joined = self.registry.joined(await self.kv.txn(self.registry.join_request(info, lease)))
        self._node_id, self._lease = info.node_id, lease
        await self._follow(joined)

    async def _follow(self, joined: Joined) -> None:
        wanted, stale = self._copy.follow(joined)
        if stale is not None:
            stale()

        def changed(changes: list[Change] | None) -> None:  # on the event loop
            if self._copy.changed(wanted.generation, changes):
                self._changed.set()
                self._tell()

        try:
            cancel: Cancel = await self.kv.watch_changes(wanted.prefix, changed,
                                                         start_revision=wanted.start_revision)
        except StoreError as exc:
            logger.warning("watch on run %s not armed (%s); reading it again",
                           self.registry.run_id, exc)
            self._copy.arm_failed(wanted.generation)
            self._tell()
            return
        late = self._copy.armed(wanted.generation, cancel)
        if late is not None:
            late()
        self._tell()

    def _tell(self) -> None:
        self.inbox.changed()
        if self._on_change is not None:
            self._on_change()

    # reading -----------------------------------------------------------------------------
    async def read(self, state: policy.AgentState, settings: policy.Settings
                   ) -> tuple[Snapshot | None, bool]:
        """As :meth:`RunWatch.read`."""
        if not read_is_due(self.inbox, state, settings, self._last_read):
            return None, False
        try:
            snapshot = await self._current(settings.retry_after.total_seconds())
        except StoreError as exc:
            logger.warning("etcd unavailable (%s)", exc)
            return None, True
        self._last_read = time.monotonic()
        return snapshot, False

    async def _current(self, patience: float) -> Snapshot:
        deadline = time.monotonic() + patience
        while not self._copy.ready and time.monotonic() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        refresh = self._copy.refresh()
        if refresh is not None:
            joined = self.registry.joined(await self.kv.txn(self.registry.claim_request(
                self._node_id, self._lease, held=refresh.held)))
            if self._copy.claimed(refresh, joined):
                await self._follow(joined)
        snapshot = self._copy.snapshot()
        if needs_registrations(snapshot):  # RunRegistry.snapshot: one range read
            prefix = self.registry.prefix
            return snapshot_from({kv.key[len(prefix):]: kv
                                  for kv in await self.kv.get_prefix(prefix)})
        return snapshot

    # writing -----------------------------------------------------------------------------
    async def propose(self, proposal: Propose) -> Round | None:
        """As :meth:`RunWatch.propose`."""
        written = self.registry.proposed(
            proposal, await self.kv.put_if(self.registry.propose_request(proposal)))
        self._copy.proposed(proposal, written)
        return written

    def close(self) -> None:
        cancel = self._copy.close()
        if cancel is not None:
            cancel()
