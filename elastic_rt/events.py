"""Structured events: a closed set of names written as JSON lines.

Events are the runtime's record of what happened and when, separate from log text.
Tests, ``elastic-rt status`` and ``elastic-rt timeline`` read them. Each line is one
JSON object::

    {"name": "round.formed", "source": "agent", "timestamp_ms": 1733140000123,
     "run_id": "demo", "node": "node-1", "rank": null, "round": 3, "step": null,
     "metadata": {"world_size": 2, "duration_ms": 41}}

Writes are appended with one ``write`` call per line, so lines from several processes
sharing a file do not interleave.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

EVENT_NAMES = frozenset(
    {
        "node.joined",
        "node.preempting",
        "node.left",
        "node.lost",
        "node.evicted",
        "node.waiting",
        "round.formed",
        "groups.reformed",
        "state.restored",
        "state.landed",
        "shares.rebalanced",
        "step.retried",
        "step.resumed",
        "step.completed",
        "leave.agreed",
        "step.failed",
        "step.stalled",
        "checkpoint.committed",
        "checkpoint.restored",
        "worker.started",
        "worker.exited",
        "worker.restarted",
        "worker.failed",
        "agent.fenced",
        "agent.exited",
        "job.finished",
    }
)


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened, with who and when."""

    name: str
    source: str
    timestamp_ms: int
    run_id: str = ""
    node: str | None = None
    rank: int | None = None
    round: int | None = None
    step: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)


class EventSink:
    """Appends events to a JSON-lines file; a sink without a path drops them.

    Args:
        path: the file to append to (created with its folder), or None.
        source: "agent" or "worker", stamped on each event.
        run_id, node, rank: stamped on each event unless given per call.
    """

    def __init__(
        self,
        path: str | None,
        *,
        source: str,
        run_id: str = "",
        node: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.path = path
        self.source = source
        self.run_id = run_id
        self.node = node
        self.rank = rank
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def emit(
        self,
        name: str,
        *,
        round: int | None = None,
        step: int | None = None,
        **metadata: Any,
    ) -> Event:
        """Record one event. Unknown names are a bug, so they raise ValueError."""
        if name not in EVENT_NAMES:
            raise ValueError(f"unknown event name {name!r}")
        event = Event(
            name=name,
            source=self.source,
            timestamp_ms=int(time.time() * 1000),
            run_id=self.run_id,
            node=self.node,
            rank=self.rank,
            round=round,
            step=step,
            metadata=metadata,
        )
        if self.path:
            line = (event.to_json() + "\n").encode()
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
        return event


def read_events(path: str) -> Iterator[Event]:
    """Yield the events in a JSON-lines file, skipping a torn last line."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                continue
            yield Event(**raw)


class JsonLinesTail:
    """Follows a JSON-lines file that others append to: each :meth:`poll` returns the
    rows added since the last one. A torn last line (a writer mid-append) is left for
    the next call; a line that is not JSON is skipped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._offset = 0

    def poll(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows
