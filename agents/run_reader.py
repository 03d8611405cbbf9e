"""Read the run's keys only when a decision needs them (see :func:`agents.policy.should_read`).

Shared by the agent and the simulated nodes, so the benchmark counts the reads an
agent makes.
"""

from __future__ import annotations

import logging
import time

from agents import policy
from agents.inbox import Inbox
from elastic_rt.errors import StoreError
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import Snapshot

logger = logging.getLogger(__name__)


class RunReader:
    def __init__(self, registry: RunRegistry, inbox: Inbox) -> None:
        self.registry = registry
        self.inbox = inbox
        self._last_read = 0.0

    def read(self, state: policy.AgentState, settings: policy.Settings
             ) -> tuple[Snapshot | None, bool]:
        """(the snapshot or None when not read this time, whether etcd failed to answer)."""
        since = time.monotonic() - self._last_read
        if not policy.should_read(state, dirty=self.inbox.dirty, since_read=since,
                                  settings=settings):
            return None, False
        self.inbox.mark_read()
        try:
            snapshot = self.registry.snapshot()
        except StoreError as exc:
            logger.warning("etcd unavailable (%s)", exc)
            return None, True
        self._last_read = time.monotonic()
        return snapshot, False
