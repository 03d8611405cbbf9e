"""What a node's agent remembers between two decisions, and its fixed rules.

Only :func:`agents.policy.decide` makes a new :class:`AgentState`; the agent and the
simulators hold the one it returned and hand it back with the next observation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta

from agents.policy.observations import FailureFacts, LeaveNotice
from elastic_rt.config import (
    DEFAULT_LEAVE_TIMEOUT,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_REFORM_TIMEOUT,
)
from elastic_rt.rendezvous.rounds import Limits, Round


class Phase(enum.Enum):
    IDLE = "idle"
    """No workers: before the first round, or after stopping them."""
    RUNNING = "running"
    """Workers run in ``state.round``."""
    REFORMING = "reforming"
    """In-process workers are joining ``state.round``, until ``state.ack_deadline``."""
    STANDBY = "standby"
    """In-process workers started outside any round wait to be admitted;
    ``state.round`` is the round they will join, numbered -1 (they are in none)."""
    FENCED = "fenced"
    """The lease was lost and the workers stopped; ``state.round`` is the round the
    node was cut from (None if it had none). Until ``state.registered`` the node is
    not registered again (see :class:`StartInStandby`)."""
    SETTLING = "settling"
    """A local worker failed and the workers are stopped; what it costs the job is
    being settled from ``state.failure`` (probe, claim, count: see failures.py)."""


@dataclass(frozen=True, slots=True)
class Leaving:
    """A notice was taken: the workers leave at their next step boundary, and the node
    after them; at ``deadline`` (monotonic) it leaves at once whatever they do."""

    notice: LeaveNotice
    deadline: float


@dataclass(frozen=True, slots=True)
class AgentState:
    """Everything the agent remembers between two decisions."""

    phase: Phase = Phase.IDLE
    round: Round | None = None
    ack_deadline: float = 0.0
    """Monotonic time by which REFORMING workers must acknowledge ``round``."""
    ever_ran: bool = False
    quorum_since: float | None = None
    """When the first round's last call started (see :func:`rounds.decide`)."""
    alarm_seen: int = 0
    """Revision of the last worker alarm answered."""
    in_process_published: bool = False
    registered: bool = True
    """False from a fence until the node registers on a new lease."""
    failure: FailureFacts | None = None
    """While SETTLING: what was learned about the failure."""
    leaving: Leaving | None = None
    """Since a notice to leave was taken (see :mod:`agents.policy.leaving`)."""

    @property
    def running(self) -> Round | None:
        """The round this node's workers belong to (or wait for, in standby)."""
        return self.round if self.phase in _WITH_WORKERS else None


_WITH_WORKERS = (Phase.RUNNING, Phase.REFORMING, Phase.STANDBY)


@dataclass(frozen=True, slots=True)
class Settings:
    """The node's fixed rules: limits, timings and the restart budget."""

    node_id: str
    limits: Limits
    monitor_interval: timedelta = DEFAULT_MONITOR_INTERVAL
    """Between two looks at the workers."""
    wait_poll: timedelta = timedelta(seconds=0.5)
    """Between two reads while waiting for a round."""
    reread_every: timedelta = timedelta(seconds=1)
    """At least this often the run is re-read while nothing wakes the agent."""
    retry_after: timedelta = timedelta(seconds=0.5)
    """After etcd did not answer."""
    join_timeout: timedelta = timedelta.max
    reform_timeout: timedelta = DEFAULT_REFORM_TIMEOUT
    max_restarts: int = DEFAULT_MAX_RESTARTS
    nproc: int = 1
    """Workers this node runs (the ranks it asks back after its workers are replaced)."""
    leave_timeout: timedelta = DEFAULT_LEAVE_TIMEOUT
    """From a notice to leaving at once, if the workers reached no step boundary by then."""
    leave_poll: timedelta = timedelta(seconds=0.01)
    """Between two looks at the workers while they head for the boundary they leave at:
    the others wait for this node's round from that boundary on."""
