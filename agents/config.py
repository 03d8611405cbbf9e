"""What one node's agent is told: the job's rendezvous, the worker command, its timings."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

from agents.output import OutputSpec
from agents.policy import Settings
from agents.preemption import NoticeSource
from elastic_rt.config import (
    DEFAULT_HANG_FACTOR,
    DEFAULT_LEAVE_TIMEOUT,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_PREEMPTION_POLL,
    DEFAULT_REFORM_TIMEOUT,
    HeartbeatConfig,
    RendezvousConfig,
)
from elastic_rt.errors import RendezvousTimeoutError
from elastic_rt.rendezvous.rounds import Limits


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything one node's agent needs."""

    rendezvous: RendezvousConfig
    command: list[str]
    """The worker command line (``python train.py --lr 3e-4``)."""
    nproc_per_node: int = 1
    max_restarts: int = DEFAULT_MAX_RESTARTS
    """Worker failures the whole job may absorb; membership changes are free."""
    monitor_interval: timedelta = DEFAULT_MONITOR_INTERVAL
    node_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    host: str = "127.0.0.1"
    """Address other nodes reach this one's workers at (MASTER_ADDR when it is rank 0)."""
    events_file: str | None = None
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (see agents.metrics); None: no endpoint."""
    grace_period: timedelta = timedelta(seconds=3)
    """SIGTERM to SIGKILL when stopping workers."""
    store_wait: timedelta = timedelta(seconds=30)
    reform_timeout: timedelta = DEFAULT_REFORM_TIMEOUT
    """In-process workers that have not joined a new round by then are restarted."""
    hang_factor: float = DEFAULT_HANG_FACTOR
    """Workers report a stall of this many median step times (see elastic_rt.worker.hang)."""
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    """How this node watches its ring neighbour (``ELASTIC_RT_HEARTBEAT_*``)."""
    output: OutputSpec = OutputSpec()
    """torchrun's --log-dir, --redirects, --tee, --local-ranks-filter and --role."""
    preemption_notice: NoticeSource | None = None
    """Where to look for a preemption notice (``--preemption-notice``); None: signals only."""
    preemption_poll: timedelta = DEFAULT_PREEMPTION_POLL
    """Between two looks at ``preemption_notice``."""
    leave_timeout: timedelta = DEFAULT_LEAVE_TIMEOUT
    """From SIGTERM or a notice to leaving at once, if no step boundary came first."""

    def join_timed_out(self, registered: int | None) -> RendezvousTimeoutError:
        """``registered``: None when etcd could not say how many nodes are there."""
        rdzv = self.rendezvous
        joined = f"only {registered} of" if registered is not None else "fewer than"
        return RendezvousTimeoutError(
            f"{joined} {rdzv.min_nodes} nodes joined run {rdzv.run_id!r} within "
            f"{rdzv.join_timeout.total_seconds():.0f} s",
            "Start more nodes, lower --nnodes MIN, or raise --join-timeout.",
        )

    def settings(self) -> Settings:
        """The rules :func:`agents.policy.decide` applies for this node."""
        rdzv = self.rendezvous
        return Settings(
            node_id=self.node_id,
            limits=Limits(min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes,
                          last_call=rdzv.last_call.total_seconds()),
            monitor_interval=self.monitor_interval,
            retry_after=self.monitor_interval * 5,
            join_timeout=rdzv.join_timeout,
            reform_timeout=self.reform_timeout,
            max_restarts=self.max_restarts,
            nproc=self.nproc_per_node,
            leave_timeout=self.leave_timeout,
        )  # fmt: skip
