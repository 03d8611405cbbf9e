"""A run's events, read back as recoveries and drawn as a picture.

``elastic-rt timeline EVENTS... -o run.png`` merges the JSON-lines event files of
every agent and worker and draws one figure, sharing a time axis (seconds since the
first event):

- **steps**: step number against time, one line per worker, coloured by node
  (only when workers wrote ``step.completed``); a line that falls back shows work
  redone from a checkpoint.
- **nodes**: one lane per node; a bar while its workers run, markers for joins,
  losses, leaves, failures and finishes.
- **recovery**: each recovery as coloured phases (detect and re-form the round,
  restart workers, re-form groups, restore state, resume) with its total time.
- **world size**: the world size of each round.

Losses and joins are vertical lines across every panel; recoveries are shaded.

The analysis half (:func:`load_events`, :func:`find_recoveries`) is pure and also
feeds ``elastic-rt status``. matplotlib is imported only when drawing, so neither
the agent nor ``status`` pays for it.

Note:
    A node killed outright writes nothing about its death. A recovery therefore
    starts at the first fault anyone reported (a failed worker, a leave, a fence),
    else at the lost node's last completed step, else at the round that dropped it;
    with agent events only, detection time before that round is not visible.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from elastic_rt.errors import ConfigError, NoEventsError
from elastic_rt.events import Event, read_events

FAULTS = frozenset({"worker.failed", "node.left", "agent.fenced", "step.retried"})
BAR_ENDS = frozenset({"worker.failed", "node.left", "agent.fenced", "job.finished", "agent.exited"})
# The phase each milestone ends; a recovery's phases follow its milestones in time order.
MILESTONES = {
    "worker.started": "restart workers",
    "worker.restarted": "restart workers",
    "groups.reformed": "re-form groups",
    "state.restored": "restore state",
    "step.resumed": "resume step",
}
# Phases come in time order, so their colours follow one ordered ramp (viridis).
PHASE_COLOURS = {
    "detect + rendezvous": "#440154",
    "restart workers": "#414487",
    "re-form groups": "#2a788e",
    "restore state": "#22a884",
    "resume step": "#7ad151",
    "first step": "#c2df23",
}


@dataclass(frozen=True, slots=True)
class Phase:
    label: str
    start_ms: int
    end_ms: int


@dataclass(frozen=True, slots=True)
class Recovery:
    """How the job got from one round to the next, and how long each part took."""

    round: int
    cause: str
    """The round's reason, as the proposer wrote it (``lost c``, ``admitting d``)."""
    world_before: int
    world_after: int
    phases: tuple[Phase, ...]
    is_start_seen: bool = True
    """False when nothing shows when a lost node died: the time since then is not counted."""

    @property
    def start_ms(self) -> int:
        return self.phases[0].start_ms

    @property
    def end_ms(self) -> int:
        return self.phases[-1].end_ms

    @property
    def duration_s(self) -> float:
        return (self.end_ms - self.start_ms) / 1000


def load_events(paths: Sequence[str]) -> list[Event]:
    """Every event in ``paths``, merged in time order, duplicates dropped.

    Raises:
        NoEventsError: a file is missing, or none of them holds an event.
    """
    for path in paths:
        if not os.path.isfile(path):
            raise NoEventsError(
                f"event file {path} does not exist", "Pass the --events-file an agent wrote."
            )
    seen: set[str] = set()
    merged = []
    for path in paths:
        for event in read_events(path):
            line = event.to_json()
            if line not in seen:
                seen.add(line)
                merged.append(event)
    if not merged:
        raise NoEventsError(
            f"no events in {', '.join(paths)}",
            "Pass a file written by elastic-rt launch --events-file after the job started.",
        )
    return sorted(merged, key=lambda e: e.timestamp_ms)


def find_recoveries(events: Sequence[Event]) -> list[Recovery]:
    """One :class:`Recovery` per round after the first, from ``events`` in time order."""
    formed = {e.round: e for e in events if e.name == "round.formed" and e.round is not None}
    recoveries = []
    window_start = 0
    for number in sorted(formed):
        event = formed[number]
        previous = formed.get(number - 1)
        if previous is None:
            window_start = event.timestamp_ms
            continue
        start = _fault_start(events, event, previous, window_start)
        phases = _phases(events, event, start)
        lost = _members(previous) - _members(event)
        recoveries.append(
            Recovery(
                round=number,
                cause=str(event.metadata.get("reason", "")),
                world_before=int(previous.metadata.get("world_size", 0)),
                world_after=int(event.metadata.get("world_size", 0)),
                phases=phases,
                is_start_seen=not lost or start < event.timestamp_ms,
            )
        )
        window_start = phases[-1].end_ms
    return recoveries


def _members(event: Event) -> set[str]:
    return set(event.metadata.get("members", ()))


def _fault_start(events: Sequence[Event], formed: Event, previous: Event, since_ms: int) -> int:
    """Best estimate of when the trouble that led to ``formed`` began."""
    now = formed.timestamp_ms
    window = [e for e in events if since_ms < e.timestamp_ms <= now]
    faults = [e.timestamp_ms for e in window if e.name in FAULTS]
    if faults:
        return min(faults)
    lost = _members(previous) - _members(formed)
    last_steps = [e.timestamp_ms for e in window if e.name == "step.completed" and e.node in lost]
    if last_steps:
        return max(last_steps)
    joined = _members(formed) - _members(previous)
    joins = [e.timestamp_ms for e in window if e.name == "node.joined" and e.node in joined]
    return min(joins, default=now)


def _phases(events: Sequence[Event], formed: Event, start: int) -> tuple[Phase, ...]:
    """Contiguous phases from ``start``: each ends when its slowest node or rank reached it."""
    now = formed.timestamp_ms
    ends: dict[str, int] = {}
    for e in events:
        if e.round == formed.round and e.name in MILESTONES and e.timestamp_ms >= now:
            label = MILESTONES[e.name]
            ends[label] = max(ends.get(label, 0), e.timestamp_ms)
    phases = [Phase("detect + rendezvous", start, now)]
    for label, end in sorted(ends.items(), key=lambda item: item[1]):
        phases.append(Phase(label, phases[-1].end_ms, end))
    if "resume step" not in ends:
        later = [e.timestamp_ms for e in events
                 if e.name == "step.completed" and e.timestamp_ms > phases[-1].end_ms]  # fmt: skip
        if later:
            phases.append(Phase("first step", phases[-1].end_ms, min(later)))
    return tuple(phases)


def describe(recovery: Recovery) -> str:
    """One line: ``round 1: lost c, world 3 -> 2, 3.1 s (detect + rendezvous 3.0 s, ...)``."""
    parts = ", ".join(
        f"{p.label} {(p.end_ms - p.start_ms) / 1000:.1f} s"
        for p in recovery.phases
        if p.end_ms > p.start_ms
    )
    return (
        f"round {recovery.round}: {recovery.cause or 'new round'}, world "
        f"{recovery.world_before} -> {recovery.world_after}, {_duration(recovery)} ({parts})"
    )


def _duration(recovery: Recovery) -> str:
    text = f"{recovery.duration_s:.1f} s"
    return text if recovery.is_start_seen else f"{text} + detection"


def draw_timeline(paths: Sequence[str], output: str) -> str:
    """Draw the events in ``paths`` to ``output`` (.png, .svg or .pdf); returns its path.

    Raises:
        NoEventsError: a file is missing or holds no events.
        ConfigError: the output's extension is not an image format.
    """
    events = load_events(paths)
    extension = os.path.splitext(output)[1].lower().lstrip(".")
    if extension not in ("png", "svg", "pdf"):
        raise ConfigError(
            f"output {output} is not .png, .svg or .pdf", "Pass for example -o run.png."
        )
    figure = _draw(events, find_recoveries(events))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    figure.savefig(output, dpi=130, bbox_inches="tight")
    return output


def node_order(events: Sequence[Event]) -> list[str]:
    """Every node named in ``events``, in natural order (``n2`` before ``n10``)."""
    nodes = {e.node for e in events if e.node}
    nodes |= {str(e.metadata["lost"])
              for e in events if e.name == "node.lost" and e.metadata.get("lost")}  # fmt: skip
    return sorted(nodes, key=_natural)


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


Bar = tuple[int, int, "int | None"]


def worker_bars(events: Sequence[Event], recoveries: Sequence[Recovery]) -> dict[str, list[Bar]]:
    """Per node, the ``(start_ms, end_ms, round)`` spans its workers ran in each round.

    A bar ends when the node's workers stop (failed, left, fenced, finished), when the
    node is lost (at the recovery's start: its last sign of life), or when a new round
    forms; workers that stay alive across rounds (in-process recovery) continue in a
    new bar for the new round.
    """
    formed = {e.round: e.timestamp_ms for e in events if e.name == "round.formed"}
    lost_at = {r.round: r.start_ms for r in recoveries}
    bars: dict[str, list[Bar]] = defaultdict(list)
    open_bar: dict[str, tuple[int, int | None]] = {}

    def close(node: str, at: int) -> None:
        if node in open_bar:
            start, number = open_bar.pop(node)
            if at > start:
                bars[node].append((start, at, number))

    for e in events:
        if e.name == "node.lost":
            close(str(e.metadata.get("lost")), lost_at.get(e.round, e.timestamp_ms))
        elif e.name == "round.formed":
            for node in set(e.metadata.get("members", ())) & set(open_bar):
                close(node, e.timestamp_ms)
                open_bar[node] = (e.timestamp_ms, e.round)
        elif not e.node or e.source != "agent":
            continue
        elif e.name in ("worker.started", "worker.restarted"):
            close(e.node, min(e.timestamp_ms, formed.get(e.round, e.timestamp_ms)))
            open_bar[e.node] = (e.timestamp_ms, e.round)
        elif e.name in BAR_ENDS:
            close(e.node, e.timestamp_ms)
    for node in list(open_bar):
        close(node, events[-1].timestamp_ms)
    return dict(bars)


def step_series(events: Sequence[Event]) -> dict[tuple[str, Any], list[tuple[int, int]]]:
    """Per worker ``(node, rank)``, its ``(timestamp_ms, step)`` points."""
    series: dict[tuple[str, Any], list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        if e.name == "step.completed" and e.step is not None:
            key = (e.node or "?", e.metadata.get("local_rank", e.rank))
            series[key].append((e.timestamp_ms, e.step))
    return dict(series)


# drawing ------------------------------------------------------------------------------
# Everything below takes matplotlib objects; only _draw imports matplotlib, and it
# builds a bare Figure (no pyplot), so no global backend state changes.
MARKERS = {
    "node.joined": (">", "#2ca02c", "joined"),
    "node.lost": ("X", "#d62728", "lost"),
    "node.left": ("s", "#ff7f0e", "left (SIGTERM)"),
    "worker.failed": ("v", "#d62728", "worker failed"),
    "agent.fenced": ("D", "#9467bd", "fenced itself"),
    "job.finished": ("P", "#222222", "finished"),
}
LINES = {
    "node.lost": ("#d62728", "--"),
    "node.left": ("#ff7f0e", "--"),
    "node.joined": ("#2ca02c", ":"),
}
SHADE = "#7f7f7f"


@dataclass(frozen=True, slots=True)
class _Frame:
    """What every panel needs: the time origin and a colour per node."""

    t0_ms: int
    end_ms: int
    colours: dict[str, Any]

    def x(self, ms: int) -> float:
        return (ms - self.t0_ms) / 1000


def _draw(events: Sequence[Event], recoveries: Sequence[Recovery]) -> Any:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    nodes = node_order(events)
    palette = colormaps["tab10"]
    frame = _Frame(events[0].timestamp_ms, events[-1].timestamp_ms,
                   {n: palette(i % 10) for i, n in enumerate(nodes)})  # fmt: skip
    steps = step_series(events)
    panels = ["steps"] if steps else []
    panels += ["nodes", "recovery", "world"] if recoveries else ["nodes", "world"]
    sizes = {"steps": 3.2, "nodes": 0.42 * len(nodes) + 0.5, "recovery": 0.55, "world": 1.2}
    figure = Figure(figsize=(12, sum(sizes[p] for p in panels) + 1.0), layout="constrained")
    axes = figure.subplots(len(panels), 1, sharex=True,
                           gridspec_kw={"height_ratios": [sizes[p] for p in panels]})  # fmt: skip
    axes = dict(zip(panels, axes if len(panels) > 1 else [axes]))
    for ax in axes.values():
        _shade_and_mark(ax, events, recoveries, frame)
    if steps:
        _draw_steps(axes["steps"], steps, recoveries, frame)
    _draw_lanes(axes["nodes"], events, recoveries, nodes, frame)
    if recoveries:
        _draw_recovery(axes["recovery"], recoveries, frame)
    _draw_world(axes["world"], events, frame)
    _label_lines(axes[panels[0]], events, frame)
    axes["world"].set_xlabel("seconds since the first event")
    axes["world"].set_xlim(-0.01 * frame.x(frame.end_ms), frame.x(frame.end_ms) * 1.02 + 0.1)
    figure.suptitle(_title(events, recoveries, nodes), fontsize=12, x=0.01, ha="left")
    _legend(figure, events, recoveries, frame)
    return figure


def _title(events: Sequence[Event], recoveries: Sequence[Recovery], nodes: list[str]) -> str:
    run_id = next((e.run_id for e in events if e.run_id), "?")
    rounds = len({e.round for e in events if e.name == "round.formed"})
    text = (f"run {run_id}: {_count(len(nodes), 'node')}, {_count(rounds, 'round')}, "
            f"{_count(len(recoveries), 'recovery', 'recoveries')}")  # fmt: skip
    if recoveries:
        durations = sorted(r.duration_s for r in recoveries)
        text += f" (median {durations[len(durations) // 2]:.1f} s, longest {durations[-1]:.1f} s)"
    return text


def _count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _shade_and_mark(
    ax: Any, events: Sequence[Event], recoveries: Sequence[Recovery], frame: _Frame
) -> None:
    for r in recoveries:
        ax.axvspan(frame.x(r.start_ms), frame.x(r.end_ms), color=SHADE, alpha=0.13, lw=0)
    for e, colour, style in _line_events(events):
        ax.axvline(frame.x(e.timestamp_ms), color=colour, ls=style, lw=1.1, alpha=0.8)
    ax.grid(axis="x", color="#dddddd", lw=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _line_events(events: Sequence[Event]) -> list[tuple[Event, str, str]]:
    """Losses, leaves, and joins after the first round: the events worth a vertical line."""
    first_round = min((e.timestamp_ms for e in events if e.name == "round.formed"), default=0)
    chosen = []
    for e in events:
        if e.name in LINES and (e.name != "node.joined" or e.timestamp_ms > first_round):
            chosen.append((e, *LINES[e.name]))
    return chosen


def _label_lines(ax: Any, events: Sequence[Event], frame: _Frame) -> None:
    span = max(frame.x(frame.end_ms), 1e-3)
    last_x, level = -1.0, 0
    for e, colour, _style in _line_events(events):
        x = frame.x(e.timestamp_ms)
        who = e.metadata.get("lost") if e.name == "node.lost" else e.node
        level = level + 1 if x - last_x < 0.06 * span else 0
        ax.annotate(f"{who} {e.name.split('.')[1]}", xy=(x, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(3, 2 + 10 * level),
                    textcoords="offset points", fontsize=8.5,
                    color=colour, fontweight="bold")  # fmt: skip
        last_x = x


def _draw_steps(ax: Any, steps: dict[tuple[str, Any], list[tuple[int, int]]],
                recoveries: Sequence[Recovery], frame: _Frame) -> None:
    workers = sorted(steps, key=lambda key: (key[0], str(key[1])))
    for i, (node, rank) in enumerate(workers):
        # Ranks of a data-parallel job move in lockstep, so their lines coincide; drawing
        # each one thinner than the last keeps every worker visible as a coloured rim.
        width = 1.2 + 3.0 * (len(workers) - 1 - i) / max(len(workers) - 1, 1)
        for segment in _segments(steps[(node, rank)], recoveries):
            ax.plot([frame.x(t) for t, _ in segment], [s for _, s in segment],
                    color=frame.colours.get(node, "#555555"), lw=width,
                    solid_capstyle="butt")  # fmt: skip
    ax.set_ylabel("step (a line per worker)")
    ax.set_ylim(bottom=0)


def _segments(
    points: list[tuple[int, int]], recoveries: Sequence[Recovery]
) -> list[list[tuple[int, int]]]:
    """Split where a step does not move forward (work redone) or a recovery lies between."""
    segments: list[list[tuple[int, int]]] = []
    for t, step in points:
        last = segments[-1][-1] if segments else None
        broken = last is None or step <= last[1] or any(
            last[0] <= r.start_ms and r.end_ms <= t for r in recoveries
        )
        if broken:
            segments.append([])
        segments[-1].append((t, step))
    return segments


def _draw_lanes(ax: Any, events: Sequence[Event], recoveries: Sequence[Recovery], nodes: list[str],
                frame: _Frame) -> None:
    lane = {n: len(nodes) - 1 - i for i, n in enumerate(nodes)}
    span = max(frame.x(frame.end_ms), 1e-3)
    for node, spans in worker_bars(events, recoveries).items():
        for start, end, number in spans:
            width = frame.x(end) - frame.x(start)
            ax.broken_barh([(frame.x(start), width)], (lane[node] - 0.28, 0.56),
                           facecolors=frame.colours[node], edgecolors="white", linewidth=1.5,
                           alpha=0.85)  # fmt: skip
            if number is not None and width > 0.07 * span:
                ax.text(frame.x(start) + width / 2, lane[node], f"round {number}", ha="center",
                        va="center", fontsize=8, color="white", fontweight="bold")  # fmt: skip
    for e in events:
        if e.name not in MARKERS or (e.name == "worker.failed" and e.source != "agent"):
            continue
        node = str(e.metadata.get("lost")) if e.name == "node.lost" else e.node
        if node in lane:
            marker, colour, _label = MARKERS[e.name]
            ax.plot(frame.x(e.timestamp_ms), lane[node], marker=marker, color=colour, ms=9,
                    mec="white", mew=0.8, zorder=5, ls="none")  # fmt: skip
    ax.set_yticks(range(len(nodes)), list(reversed(nodes)))
    ax.set_ylim(-0.6, len(nodes) - 0.4)
    ax.set_ylabel("node")


def _draw_recovery(ax: Any, recoveries: Sequence[Recovery], frame: _Frame) -> None:
    for r in recoveries:
        for p in r.phases:
            start = frame.x(p.start_ms)
            ax.broken_barh([(start, frame.x(p.end_ms) - start)], (0.15, 0.7),
                           facecolors=PHASE_COLOURS[p.label])  # fmt: skip
        ax.annotate(_duration(r), xy=(frame.x(r.end_ms), 0.5), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=9,
                    fontweight="bold")  # fmt: skip
    ax.set_yticks([])
    ax.set_ylim(0, 1)
    ax.set_ylabel("recovery", rotation=0, ha="right", va="center")


def _draw_world(ax: Any, events: Sequence[Event], frame: _Frame) -> None:
    formed = sorted((e for e in events if e.name == "round.formed"), key=lambda e: e.timestamp_ms)
    if not formed:
        ax.text(0.5, 0.5, "no round formed", transform=ax.transAxes, ha="center", va="center")
        return
    xs = [frame.x(e.timestamp_ms) for e in formed] + [frame.x(frame.end_ms)]
    ys = [int(e.metadata.get("world_size", 0)) for e in formed]
    ax.step(xs, ys + ys[-1:], where="post", color="#333333", lw=1.8)
    ax.fill_between(xs, ys + ys[-1:], step="post", color="#999999", alpha=0.18)
    for e, x, y in zip(formed, xs, ys):
        ax.annotate(f"round {e.round}: {y}", xy=(x, y), xytext=(4, 3), textcoords="offset points",
                    fontsize=8.5, va="bottom")  # fmt: skip
    ax.set_ylim(0, max(ys) * 1.45 + 0.5)
    ax.set_yticks(sorted(set(ys)))
    ax.set_ylabel("world size")


def _legend(
    figure: Any, events: Sequence[Event], recoveries: Sequence[Recovery], frame: _Frame
) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=colour, label=n if n.startswith("node") else f"node {n}")
               for n, colour in frame.colours.items()]  # fmt: skip
    present = {e.name for e in events}
    handles += [Line2D([], [], marker=m, color=c, ls="none", ms=8, label=label)
                for name, (m, c, label) in MARKERS.items() if name in present]  # fmt: skip
    phases = {p.label for r in recoveries for p in r.phases}
    handles += [Patch(color=c, label=p) for p, c in PHASE_COLOURS.items() if p in phases]
    figure.legend(handles=handles, loc="outside right center", fontsize=8.5, frameon=False)
