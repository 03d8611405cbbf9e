"""Drawing a run's timeline with matplotlib (the analysis is in :mod:`.timeline`).

This module depends on :mod:`.timeline` and not the reverse, so the analysis stays
importable without any drawing code. Only :func:`draw` imports matplotlib, and it
builds a bare Figure (no pyplot), so no global backend state changes and importing
this module costs nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from elastic_rt.errors import ConfigError
from elastic_rt.events import Event
from elastic_rt.ops.timeline import (
    PHASE_COLOURS,
    Recovery,
    duration_text,
    find_recoveries,
    job_end_ms,
    load_events,
    never_admitted,
    node_order,
    rounds_formed,
    step_series,
    worker_bars,
)
from elastic_rt.rendezvous.rounds import SPARE


MARKERS = {
    "node.joined": (">", "#2ca02c", "joined"),
    "node.lost": ("X", "#d62728", "lost"),
    "node.preempting": ("^", "#ff7f0e", "told to leave (SIGTERM, preemption notice)"),
    "node.left": ("s", "#ff7f0e", "left"),
    "worker.failed": ("v", "#d62728", "worker failed"),
    "agent.fenced": ("D", "#9467bd", "fenced itself"),
    "job.finished": ("P", "#222222", "finished"),
    "spare": ("o", "#17becf", "waiting as a spare"),
    "shares.rebalanced": ("*", "#bcbd22", "straggler's share cut"),
}
"""Marker, colour and legend label by event name; ``spare`` is a ``node.waiting`` event
whose reason is :data:`~elastic_rt.rendezvous.rounds.SPARE`; ``shares.rebalanced`` is
drawn on the lane of the node given the smallest share."""
LINES = {
    "node.lost": ("#d62728", "--"),
    "node.left": ("#ff7f0e", "--"),
    "node.joined": ("#2ca02c", ":"),
}
SHADE = "#7f7f7f"
CHECKPOINT = ("d", "#111111", "checkpoint committed")
ZOOM_BELOW = 0.04
"""A recovery shorter than this share of the time axis also gets a zoomed panel."""
DODGE_PT = 2.5
"""Step lines of successive workers are drawn this many points apart (they coincide)."""


@dataclass(frozen=True, slots=True)
class _Frame:
    """What every panel needs: the time origin and a colour per node."""

    t0_ms: int
    end_ms: int
    colours: dict[str, Any]

    def x(self, ms: int) -> float:
        return (ms - self.t0_ms) / 1000


def draw(events: Sequence[Event], recoveries: Sequence[Recovery]) -> Any:
    """The figure of a run: panels for steps, node lanes, recoveries and world size."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    nodes = node_order(events)
    palette = colormaps["tab10"]
    frame = _Frame(events[0].timestamp_ms, job_end_ms(events),
                   {n: palette(i % 10) for i, n in enumerate(nodes)})  # fmt: skip
    steps = step_series(events)
    panels = ["steps"] if steps else []
    panels += ["nodes", "recovery", "world"] if recoveries else ["nodes", "world"]
    sizes = {"steps": 3.2, "nodes": 0.42 * len(nodes) + 0.5, "recovery": 0.55, "world": 1.2}
    span_ms = max(frame.end_ms - frame.t0_ms, 1)
    short = [r for r in recoveries if r.end_ms - r.start_ms < ZOOM_BELOW * span_ms][:4]
    height = sum(sizes[p] for p in panels) + 1.0
    figure = Figure(figsize=(12, height + (1.4 if short else 0)), layout="constrained")
    top: Any = figure
    if short:
        top, bottom = figure.subfigures(2, 1, height_ratios=[height, 1.4])  # type: ignore[misc]
        _draw_zooms(bottom.subplots(1, len(short), squeeze=False)[0], short)
    axes = top.subplots(len(panels), 1, sharex=True,
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
    _draw_checkpoints(axes["steps"] if steps else axes["world"], events, frame, bool(steps))
    _label_lines(axes[panels[0]], events, frame)
    axes["world"].set_xlabel("seconds since the first event")
    axes["world"].set_xlim(-0.01 * frame.x(frame.end_ms), frame.x(frame.end_ms) * 1.02 + 0.1)
    figure.suptitle(_title(events, recoveries, nodes), fontsize=12, x=0.01, ha="left")
    _legend(top, events, recoveries, frame)
    return figure


def _title(events: Sequence[Event], recoveries: Sequence[Recovery], nodes: list[str]) -> str:
    run_id = next((e.run_id for e in events if e.run_id), "?")
    rounds = len({e.round for e in rounds_formed(events)})
    text = (f"run {run_id}: {_count(len(nodes), 'node')}, {_count(rounds, 'round')}, "
            f"{_count(len(recoveries), 'recovery', 'recoveries')}")  # fmt: skip
    ordered = sorted(recoveries, key=lambda r: r.duration_s)
    if len(ordered) == 1:
        text += f" ({duration_text(ordered[0])})"
    elif ordered:
        text += (f" (median {duration_text(ordered[len(ordered) // 2])}, "
                 f"longest {duration_text(ordered[-1])})")  # fmt: skip
    waiting = never_admitted(events)
    if waiting:
        text += f"; {', '.join(sorted(waiting))} never admitted"
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
    """Losses, leaves, and joins after the first round that led to an admission: the
    events worth a vertical line (a node never admitted changed nothing)."""
    first_round = min((e.timestamp_ms for e in rounds_formed(events)), default=0)
    waiting = never_admitted(events)
    chosen = []
    for e in events:
        is_join = e.name == "node.joined"
        if e.name in LINES and (not is_join or e.timestamp_ms > first_round
                                and e.node not in waiting):  # fmt: skip
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
    from matplotlib.transforms import offset_copy

    workers = sorted(steps, key=lambda key: (key[0], str(key[1])))
    for i, (node, rank) in enumerate(workers):
        # Ranks of a data-parallel job move in lockstep, so their lines coincide: each
        # is drawn DODGE_PT points above the last (a fixed distance on paper, whatever
        # the step range), and the axis label says so.
        dodge = offset_copy(ax.transData, fig=ax.figure, y=DODGE_PT * i, units="points")
        for segment in _segments(steps[(node, rank)], recoveries):
            ax.plot([frame.x(t) for t, _ in segment], [s for _, s in segment],
                    color=frame.colours.get(node, "#555555"), lw=1.6, transform=dodge,
                    solid_capstyle="butt")  # fmt: skip
    ax.set_ylabel(f"step (a line per worker,\n{DODGE_PT:g} pt apart)")
    # Lines drawn through an offset transform do not widen the data limits.
    top = max(step for points in steps.values() for _, step in points)
    ax.set_ylim(0, top * 1.08 + 1)


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
    waiting = never_admitted(events)
    _draw_waiting(ax, events, waiting, lane, frame)
    _draw_leaving(ax, events, lane, frame)
    for node, spans in worker_bars(events, recoveries).items():
        for start, end, number in spans:
            if node in waiting or start >= frame.end_ms:
                continue  # standby workers of a node never admitted did no training
            width = frame.x(min(end, frame.end_ms)) - frame.x(start)
            ax.broken_barh([(frame.x(start), width)], (lane[node] - 0.28, 0.56),
                           facecolors=frame.colours[node], edgecolors="white", linewidth=1.5,
                           alpha=0.85)  # fmt: skip
            if number is not None and width > 0.07 * span:
                ax.text(frame.x(start) + width / 2, lane[node], f"round {number}", ha="center",
                        va="center", fontsize=8, color="white", fontweight="bold")  # fmt: skip
    for e in events:
        if _marked(e) not in MARKERS or (e.name == "worker.failed" and e.source != "agent"):
            continue
        who = _lane_of(e)
        if who in lane and who not in waiting and e.timestamp_ms <= frame.end_ms:
            marker, colour, _label = MARKERS[_marked(e)]
            ax.plot(frame.x(e.timestamp_ms), lane[who], marker=marker, color=colour, ms=9,
                    mec="white", mew=0.8, zorder=5, ls="none")  # fmt: skip
    labels = [f"{n}\n(never admitted)" if n in waiting else n for n in reversed(nodes)]
    ax.set_yticks(range(len(nodes)), labels)
    ax.set_ylim(-0.6, len(nodes) - 0.4)
    ax.set_ylabel("node")


def _lane_of(event: Event) -> str | None:
    """The node an event is drawn on: the one lost, the one given the smallest share (as
    rank 0 saw it: every rank says the same), else the one that wrote it."""
    if event.name == "node.lost":
        return str(event.metadata.get("lost"))
    if event.name == "shares.rebalanced":
        weights = event.metadata.get("weights")
        if event.rank != 0 or not weights:
            return None
        return str(min(zip(weights, event.metadata["nodes"]))[1])
    return event.node


def _marked(event: Event) -> str:
    """The key of :data:`MARKERS` an event is drawn with (a spare's wait is its own)."""
    if event.name == "node.waiting" and event.metadata.get("reason") == SPARE:
        return "spare"
    return event.name


def _draw_waiting(ax: Any, events: Sequence[Event], waiting: set[str], lane: dict[str, int],
                  frame: _Frame) -> None:
    """A node never admitted: a hatched span from its join to the job's end, no bar."""
    for node in waiting:
        joined = min(e.timestamp_ms for e in events if e.node == node and e.name == "node.joined")
        if joined >= frame.end_ms:
            continue
        ax.broken_barh([(frame.x(joined), frame.x(frame.end_ms) - frame.x(joined))],
                       (lane[node] - 0.2, 0.4), facecolors="none", edgecolors="#999999",
                       hatch="///", linewidth=0.8)  # fmt: skip
        spare = any(_marked(e) == "spare" for e in events if e.node == node)
        ax.text(frame.x(joined), lane[node] + 0.3,
                " waiting as a spare" if spare else " waiting to be admitted", fontsize=8,
                color="#666666", va="bottom")  # fmt: skip


def _draw_leaving(ax: Any, events: Sequence[Event], lane: dict[str, int], frame: _Frame) -> None:
    """A node told to leave: a hatched frame around its bar from the notice to its leave
    (it trains on to the next step boundary meanwhile)."""
    for notice in (e for e in events if e.name == "node.preempting" and e.node in lane):
        left = [e.timestamp_ms for e in events if e.name == "node.left" and e.node == notice.node
                and e.timestamp_ms >= notice.timestamp_ms]
        start, end = frame.x(notice.timestamp_ms), frame.x(min(left, default=frame.end_ms))
        ax.broken_barh([(start, end - start)],
                       (lane[str(notice.node)] - 0.36, 0.72), facecolors="none",
                       edgecolors=MARKERS["node.preempting"][1], hatch="////", linewidth=0.8,
                       zorder=4)  # fmt: skip


def _draw_checkpoints(ax: Any, events: Sequence[Event], frame: _Frame, on_steps: bool) -> None:
    """Committed checkpoints: at their step on the steps panel, else along the bottom."""
    marker, colour, _label = CHECKPOINT
    for e in events:
        if e.name != "checkpoint.committed" or e.timestamp_ms > frame.end_ms:
            continue
        y = e.step if on_steps and e.step is not None else 0
        ax.plot(frame.x(e.timestamp_ms), y, marker=marker, color=colour, ms=6, mec="white",
                mew=0.6, zorder=6, ls="none", clip_on=False)  # fmt: skip


def _draw_zooms(axes: Any, recoveries: Sequence[Recovery]) -> None:
    """Short recoveries on their own millisecond axis: a sliver on the run's axis."""
    for ax, r in zip(axes, recoveries):
        for p in r.phases:
            ax.broken_barh([(p.start_ms - r.start_ms, p.end_ms - p.start_ms)], (0.15, 0.7),
                           facecolors=PHASE_COLOURS[p.label])  # fmt: skip
        ax.set_title(f"round {r.round} zoomed: {duration_text(r)}", fontsize=9, loc="left")
        ax.set_xlim(0, max(r.end_ms - r.start_ms, 1) * 1.05)
        ax.set_xlabel("ms since its start", fontsize=8)
        ax.set_yticks([])
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)


def _draw_recovery(ax: Any, recoveries: Sequence[Recovery], frame: _Frame) -> None:
    for r in recoveries:
        for p in r.phases:
            start = frame.x(p.start_ms)
            ax.broken_barh([(start, frame.x(p.end_ms) - start)], (0.15, 0.7),
                           facecolors=PHASE_COLOURS[p.label])  # fmt: skip
        ax.annotate(duration_text(r), xy=(frame.x(r.end_ms), 0.5), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=9,
                    fontweight="bold")  # fmt: skip
    ax.set_yticks([])
    ax.set_ylim(0, 1)
    ax.set_ylabel("recovery", rotation=0, ha="right", va="center")


def _draw_world(ax: Any, events: Sequence[Event], frame: _Frame) -> None:
    formed = sorted(rounds_formed(events), key=lambda e: e.timestamp_ms)
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

    handles: list[Patch | Line2D] = [
        Patch(color=colour, label=n if n.startswith("node") else f"node {n}")
        for n, colour in frame.colours.items()
    ]
    present = {_marked(e) for e in events}
    handles += [Line2D([], [], marker=m, color=c, ls="none", ms=8, label=label)
                for name, (m, c, label) in MARKERS.items() if name in present]  # fmt: skip
    if "checkpoint.committed" in present:
        marker, colour, label = CHECKPOINT
        handles.append(Line2D([], [], marker=marker, color=colour, ls="none", ms=7, label=label))
    phases = {p.label for r in recoveries for p in r.phases}
    handles += [Patch(color=c, label=p) for p, c in PHASE_COLOURS.items() if p in phases]
    figure.legend(handles=handles, loc="outside right center", fontsize=8.5, frameon=False)


def draw_timeline(paths: Sequence[str], output: str) -> str:
    """Draw the events in ``paths`` to ``output`` (.png, .svg or .pdf); returns its path.

    Raises:
        NoEventsError: a file is missing, binary, not events, or holds no events.
        ConfigError: the output's extension is not an image format, or its folder is
            missing or not writable (nothing is created).
    """
    check_output(output)
    events = load_events(paths)
    figure = draw(events, find_recoveries(events))
    figure.savefig(output, dpi=130, bbox_inches="tight")
    return output


def check_output(output: str) -> None:
    """Refuse an output that cannot be written, before any work and creating nothing.

    Raises:
        ConfigError: not .png, .svg or .pdf, or its folder is missing or read-only.
    """
    extension = os.path.splitext(output)[1].lower().lstrip(".")
    if extension not in ("png", "svg", "pdf"):
        raise ConfigError(
            f"output {output} is not .png, .svg or .pdf", "Pass for example -o run.png."
        )
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ConfigError(f"output folder {folder} does not exist",
                          "Create it first, or pass -o in an existing folder.")  # fmt: skip
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"output folder {folder} is not writable", "Pass -o somewhere writable.")
