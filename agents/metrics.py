"""Prometheus metrics for one node, served by its agent (``--metrics-port``).

The figures are a fold over the node's JSON-lines events, the agent's and its
workers' (one file), so they say what ``elastic-rt status`` and the timeline say and
a worker needs no HTTP server of its own. The agent adds what only it knows: the
round it follows and the job's restart budget. Every series carries ``run_id`` and
``node``; sum over ``node`` for the job's totals.

Counted once per node: rounds, recoveries (the first step of a new round after a
step in an earlier one), steps (by step number, whatever the number of local
workers), checkpoint loads (per round and checkpoint). Checkpoint saves are counted
by the node whose worker committed them (the save group's rank 0).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from elastic_rt.errors import ConfigError
from elastic_rt.events import JsonLinesTail
from elastic_rt.rendezvous.rounds import Round

logger = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_RATE_WINDOW_S = 30.0
"""The step rate is the steps completed in this many seconds before a scrape."""
POLL_S = 0.5
LABELS = ("run_id", "node")


def recovery_cause(round_: Round) -> str:
    """Why a round was formed, as a label with few values (the reason text names nodes)."""
    reason = round_.reason
    if round_.number == 0:
        return "start"
    if reason.startswith("lost "):
        return "node_lost"
    if reason.startswith("left "):
        return "node_left"
    if reason.startswith("admitting "):
        return "node_joined"
    if reason.startswith("paused"):
        return "paused"
    if reason.startswith("resumed"):
        return "resumed"
    return "worker_failure"


class NodeMetrics:
    """The node's figures in a registry of their own (not the process-wide default,
    so tests and a second agent in one process do not collide)."""

    def __init__(self, run_id: str, node: str, *, max_restarts: int) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._labels = (run_id, node)
        self._max_restarts = max_restarts
        self._define()
        self._causes: dict[int, str] = {}
        self._rounds_seen: set[int] = set()
        self._highest_step = 0
        self._step_round: int | None = None
        self._last_step_ms: int | None = None
        self._step_times: collections.deque[float] = collections.deque()
        self._loads_seen: set[tuple[Any, Any]] = set()
        self._restores_seen: set[Any] = set()
        self._pending: dict[Any, list[float]] = {}
        """Downtimes of recoveries into rounds the agent has not read yet (so no cause)."""

    def _counter(self, name: str, doc: str, *extra: str) -> Counter:
        return Counter(f"elastic_rt_{name}", doc, LABELS + extra, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"elastic_rt_{name}", doc, LABELS, registry=self.registry)

    def _histogram(self, name: str, doc: str, *extra: str) -> Histogram:
        return Histogram(f"elastic_rt_{name}", doc, LABELS + extra, registry=self.registry,
                         buckets=SECONDS_BUCKETS)

    def _define(self) -> None:
        c, g, h = self._counter, self._gauge, self._histogram
        self.rounds = c("rounds", "Rounds this node saw formed (a re-form is a new round)")
        self.round = g("round", "The number of the round the node is in")
        self.members = g("members", "Nodes in the current round")
        self.world_size = g("world_size", "Workers in the current round")
        self.recoveries = c("recoveries", "Re-forms after which this node's workers trained "
                            "again, by cause", "cause")
        self.downtime = h("recovery_downtime_seconds", "Last step before a re-form to the "
                          "first step after it, on this node", "cause")
        self.steps = c("steps_completed", "Steps this node's workers completed (each step "
                       "number once)")
        self.step = g("step", "The last step completed")
        self.steps_redone = c("steps_redone", "Steps trained again after a recovery")
        self.step_failures = c("step_failures", "Steps that raised in a worker")
        self.worker_restarts = c("worker_restarts", "Times the agent restarted its workers")
        self.saves = c("checkpoint_saves", "Checkpoints committed by this node's worker")
        self.save_seconds = h("checkpoint_save_seconds", "Checkpoint write, start to commit")
        self.save_blocking = h("checkpoint_save_blocking_seconds",
                               "Training paused by a checkpoint save")
        self.saved_bytes = c("checkpoint_saved_bytes", "Bytes in committed checkpoints")
        self.loads = c("checkpoint_loads", "Checkpoint loads on this node")
        self.load_seconds = h("checkpoint_load_seconds", "Checkpoint load, per worker")
        self.loaded_bytes = c("checkpoint_loaded_bytes", "Size of the checkpoints loaded")
        self.restores = c("state_restores", "Restores of training state after a re-form, by "
                          "source", "source")
        self.restored_bytes = c("state_restored_bytes", "State bytes moved to this node's "
                                "workers by restores")
        self.evictions = c("heartbeat_evictions", "Peers this node evicted as hung")
        self.nodes_lost = c("nodes_lost", "Nodes this node saw lost from a round")
        for child in (self.rounds, self.steps, self.steps_redone, self.step_failures,
                      self.worker_restarts, self.saves, self.saved_bytes, self.loads,
                      self.loaded_bytes, self.restored_bytes, self.evictions, self.nodes_lost):
            child.labels(*self._labels)  # present (at 0) from the first scrape
        self.step_rate = g("step_rate", f"Steps a second over the last {STEP_RATE_WINDOW_S:g} s")
        self.step_rate.labels(*self._labels).set_function(self._rate)
        self.restarts_left = g("restarts_left", "Worker-failure restarts the job may still "
                               "absorb, as of the current round")
        self.restarts_left.labels(*self._labels).set(self._max_restarts)

    # what the agent knows --------------------------------------------------------
    def saw_round(self, round_: Round) -> None:
        """The round the agent follows now; called on each read of the run."""
        with self._lock:
            if round_.number in self._rounds_seen:
                return
            self._rounds_seen.add(round_.number)
            self._causes[round_.number] = recovery_cause(round_)
            self.rounds.labels(*self._labels).inc()
            self.round.labels(*self._labels).set(round_.number)
            self.members.labels(*self._labels).set(len(round_.members))
            self.world_size.labels(*self._labels).set(round_.world_size)
            self.restarts_left.labels(*self._labels).set(
                max(0, self._max_restarts - round_.restarts))
            for downtime in self._pending.pop(round_.number, []):
                self._recovered(self._causes[round_.number], downtime)

    def _recovered(self, cause: str, downtime_s: float) -> None:
        self.recoveries.labels(*self._labels, cause).inc()
        self.downtime.labels(*self._labels, cause).observe(downtime_s)

    def _rate(self) -> float:
        with self._lock:
            cutoff = time.time() - STEP_RATE_WINDOW_S
            while self._step_times and self._step_times[0] < cutoff:
                self._step_times.popleft()
            return len(self._step_times) / STEP_RATE_WINDOW_S

    # what the events say -----------------------------------------------------------
    def observe(self, event: dict[str, Any]) -> None:
        """Fold one event (a row of the events file) into the figures."""
        if (event.get("run_id"), event.get("node")) != self._labels:
            return  # a file shared by several nodes (one host's test, a shared disk)
        name, meta = event.get("name"), event.get("metadata") or {}
        with self._lock:
            match name:
                case "step.completed":
                    self._step_completed(event)
                case "step.failed" | "step.retried":
                    self.step_failures.labels(*self._labels).inc()
                case "worker.restarted":
                    self.worker_restarts.labels(*self._labels).inc()
                case "checkpoint.committed":
                    self.saves.labels(*self._labels).inc()
                    self.saved_bytes.labels(*self._labels).inc(meta.get("nbytes") or 0)
                    self.save_seconds.labels(*self._labels).observe(_seconds(meta, "write_ms"))
                    self.save_blocking.labels(*self._labels).observe(
                        _seconds(meta, "blocking_ms"))
                case "checkpoint.restored":
                    self.load_seconds.labels(*self._labels).observe(_seconds(meta, "duration_ms"))
                    key = (event.get("round"), meta.get("checkpoint"))
                    if key not in self._loads_seen:
                        self._loads_seen.add(key)
                        self.loads.labels(*self._labels).inc()
                        self.loaded_bytes.labels(*self._labels).inc(meta.get("nbytes") or 0)
                case "state.restored":
                    self.restored_bytes.labels(*self._labels).inc(meta.get("bytes_moved") or 0)
                    if event.get("round") not in self._restores_seen:
                        self._restores_seen.add(event.get("round"))
                        source = str(meta.get("source") or "unknown")
                        self.restores.labels(*self._labels, source).inc()
                case "node.evicted":
                    self.evictions.labels(*self._labels).inc()
                case "node.lost":
                    self.nodes_lost.labels(*self._labels).inc()

    def _step_completed(self, event: dict[str, Any]) -> None:
        step, round_number, at_ms = event.get("step"), event.get("round"), event["timestamp_ms"]
        if not isinstance(step, int):
            return
        if round_number != self._step_round:
            # The first step this node's workers completed in a new round: a recovery,
            # unless the node never trained before (its first round, or a newcomer).
            if self._last_step_ms is not None and self._step_round is not None:
                downtime = max(0.0, (at_ms - self._last_step_ms) / 1000)
                if round_number in self._causes:
                    self._recovered(self._causes[round_number], downtime)
                else:  # the workers are ahead of the agent's read of the run
                    self._pending.setdefault(round_number, []).append(downtime)
                if step <= self._highest_step:
                    self.steps_redone.labels(*self._labels).inc(self._highest_step - step + 1)
            self._step_round = round_number
        if step > self._highest_step:
            self.steps.labels(*self._labels).inc()
            self._highest_step = step
            self.step.labels(*self._labels).set(step)
            self._step_times.append(at_ms / 1000)
        self._last_step_ms = at_ms


def _seconds(meta: dict[str, Any], key: str) -> float:
    value = meta.get(key)
    return float(value) / 1000 if isinstance(value, (int, float)) else 0.0


class MetricsServer:
    """The HTTP endpoint and the thread that follows the events file into the figures."""

    def __init__(self, metrics: NodeMetrics, events_file: str, *, port: int,
                 host: str = "127.0.0.1") -> None:
        self.metrics = metrics
        self._tail = JsonLinesTail(events_file)
        self._stop = threading.Event()
        try:
            self._server, self._server_thread = start_http_server(
                port, addr=host, registry=metrics.registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc})",
                              "Pick a free --metrics-port, or leave it out.") from exc
        self.port = self._server.server_port
        self._follower = threading.Thread(target=self._follow, name="metrics-events",
                                          daemon=True)
        self._follower.start()
        logger.info("metrics at http://%s:%d/metrics", host, self.port)

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Fold the events written since the last poll."""
        for row in self._tail.poll():
            self.metrics.observe(row)

    def close(self) -> None:
        self._stop.set()
        self._follower.join(timeout=5)
        self.poll()
        self._server.shutdown()
        self._server.server_close()
