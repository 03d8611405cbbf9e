"""Each worker's footprint curve, read off its ``groups.reformed`` events; pure.

Every re-form, a worker reports what it holds (``elastic_rt/worker/footprint.py``):
threads, open descriptors, resident bytes, and process groups of abandoned rounds.
A worker that keeps something per round grows along its re-forms: the curve of the
longest-lived worker (the one through the most re-forms) and its least-squares slope
per re-form say whether it is flat. Worker events carry no PID, but each node runs
one worker, so a node's events belong to the worker its agent started last
(``worker.started`` / ``worker.restarted`` carry its PID).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_rt.events import Event

FIGURES = ("threads", "open_fds", "rss_bytes", "abandoned_groups")


@dataclass(frozen=True)
class Curve:
    """One worker's footprint at each of its ``groups.reformed`` events, in order."""

    node: str
    pid: int
    points: tuple[dict[str, int], ...]

    @property
    def reforms(self) -> int:
        """Re-forms it went through (its first formation is not one)."""
        return max(0, len(self.points) - 1)

    def values(self, figure: str) -> list[int]:
        return [p[figure] for p in self.points if p.get(figure) is not None]

    def slope(self, figure: str) -> float:
        """Least-squares growth per re-form (0 with fewer than two points)."""
        return slope(self.values(figure))


def curves(events: list[Event]) -> list[Curve]:
    """Every worker's curve, in the order the workers started."""
    current: dict[str, int] = {}
    points: dict[tuple[str, int], list[dict[str, int]]] = {}
    for event in events:
        node = event.node or ""
        if event.name in ("worker.started", "worker.restarted") and event.metadata.get("pids"):
            current[node] = int(event.metadata["pids"][0])
            points.setdefault((node, current[node]), [])
        elif (event.name == "groups.reformed" and event.source == "worker" and node in current
              and "footprint" in event.metadata):
            points[(node, current[node])].append(dict(event.metadata["footprint"]))
    return [Curve(node, pid, tuple(p)) for (node, pid), p in points.items() if p]


def longest_lived(found: list[Curve]) -> Curve | None:
    """The curve through the most re-forms (the first such worker on a tie)."""
    return max(found, key=lambda c: c.reforms, default=None)


def slope(values: list[int]) -> float:
    """The least-squares slope of ``values`` against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return num / sum((x - mean_x) ** 2 for x in range(n))
