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

This module is the analysis half (:func:`load_events`, :func:`find_recoveries`): pure,
and it also feeds ``elastic-rt status``. Drawing (:func:`.timeline_draw.draw_timeline`)
imports this module, never the other way round; it is the only place matplotlib is
imported, so neither the agent nor ``status`` pays for it.

Note:
    A node killed outright writes nothing about its death. A recovery therefore
    starts at the first fault anyone reported (a failed worker, a leave, a fence),
    else at the lost node's last completed step, else at the round that dropped it;
    with agent events only, detection time before that round is not visible.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from elastic_rt.errors import NoEventsError
from elastic_rt.events import Event

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
    def is_end_seen(self) -> bool:
        """Whether a worker reported training again; else the end is the workers'
        (re)start, and their start-up (importing torch, the first step) is not counted."""
        return self.phases[-1].label in ("resume step", "first step")

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
        for event in _read_strictly(path):
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


def _read_strictly(path: str) -> list[Event]:
    """The file's events. A line that is not JSON is skipped (a writer killed mid-append
    tears one); JSON that is not an event means a wrong file, and is named.

    Raises:
        NoEventsError: the file is binary, or a line is JSON but not an event.
    """
    fix = "Pass a JSON-lines file written by elastic-rt launch --events-file."
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except UnicodeDecodeError as exc:
        raise NoEventsError(f"event file {path} is not text (byte {exc.start})", fix) from None
    events = []
    for number, line in enumerate(lines, start=1):
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        event = _as_event(raw)
        if event is None:
            raise NoEventsError(f"event file {path} line {number} is not an event", fix)
        events.append(event)
    return events


def _as_event(raw: Any) -> Event | None:
    if not isinstance(raw, dict):
        return None
    try:
        event = Event(**raw)
    except TypeError:
        return None
    ok = isinstance(event.name, str) and isinstance(event.timestamp_ms, int)
    return event if ok else None


def rounds_formed(events: Sequence[Event]) -> list[Event]:
    """The agents' ``round.formed`` events, which carry the members and the reason.

    Workers report ``round.formed`` too, when they notice a new round, as a phase of
    their recovery; those lack members and must not stand for the round.
    """
    return [e for e in events if e.name == "round.formed" and e.source == "agent"]


def find_recoveries(events: Sequence[Event]) -> list[Recovery]:
    """One :class:`Recovery` per round after the first, from ``events`` in time order.

    In restart mode a round can be overtaken before its workers ever start (a
    survivor's worker fails, its restart round forms with the dead node still a
    member, then the lease expires and another round drops it). Such a round is no
    recovery of its own: it and the ones after it are one recovery, timed from the
    first fault to the workers of the round that held.
    """
    formed = {e.round: e for e in rounds_formed(events) if e.round is not None}
    recoveries = []
    window_start = 0
    chain: list[Event] = []
    """Rounds overtaken before their workers ran, after the last round that trained."""
    before: Event | None = None
    """The round before the first of ``chain`` (before the trouble)."""
    for number in sorted(formed):
        event = formed[number]
        previous = formed.get(number - 1)
        if previous is None:
            window_start = event.timestamp_ms
            continue
        if not chain:
            before = previous
        if _is_overtaken(events, event, formed.get(number + 1)):
            chain.append(event)
            continue
        base = before or previous
        start = _fault_start(events, event, base, window_start)
        phases = _phases(events, event, start)
        lost = _members(base) - _members(event)
        recoveries.append(
            Recovery(
                round=number,
                cause=", then ".join(str(e.metadata.get("reason", "")) for e in [*chain, event]),
                world_before=int(base.metadata.get("world_size", 0)),
                world_after=int(event.metadata.get("world_size", 0)),
                phases=phases,
                is_start_seen=not lost or _last_step_seen(events, lost, window_start, event),
            )
        )
        chain = []
        window_start = phases[-1].end_ms
    return recoveries


def _last_step_seen(events: Sequence[Event], lost: set[str], since_ms: int, formed: Event) -> bool:
    """Whether a lost node's last step is in the window: without it, the time between
    its death and the first report (a survivor's failure, the lease expiry) is unseen."""
    return any(e.name == "step.completed" and e.node in lost
               and since_ms < e.timestamp_ms <= formed.timestamp_ms for e in events)  # fmt: skip


def _is_overtaken(events: Sequence[Event], formed: Event, following: Event | None) -> bool:
    """A restart-mode round whose workers never started before the next round formed."""
    if following is None:
        return False
    ran = {"worker.started", "worker.restarted", "groups.reformed", "step.resumed"}
    for e in events:
        if e.round == formed.round and e.name in ran:
            return False
        between = formed.timestamp_ms < e.timestamp_ms < following.timestamp_ms
        if e.name == "step.completed" and between:
            return False
    return any(e.name == "worker.restarted" and e.round == following.round for e in events)


def _members(event: Event) -> set[str]:
    return set(event.metadata.get("members", ()))


def _fault_start(events: Sequence[Event], formed: Event, previous: Event, since_ms: int) -> int:
    """Best estimate of when the trouble that led to ``formed`` began."""
    now = formed.timestamp_ms
    window = [e for e in events if since_ms < e.timestamp_ms <= now]
    faults = [e.timestamp_ms for e in window if e.name in FAULTS]
    lost = _members(previous) - _members(formed)
    last_steps = [e.timestamp_ms for e in window if e.name == "step.completed" and e.node in lost]
    if faults or last_steps:
        # The earliest evidence: a lost node died after its last step, and survivors
        # may report the fault seconds later (restart mode: a collective times out).
        return min(faults + last_steps[-1:])
    joined = _members(formed) - _members(previous)
    joins = [e.timestamp_ms for e in window if e.name == "node.joined" and e.node in joined]
    # Growth: training stops when the survivors leave their round, which in-process is
    # after the newcomer's workers have started (the survivors train on meanwhile).
    steps = [e.timestamp_ms for e in window if e.name == "step.completed"]
    return max(min(joins, default=now), max(steps, default=0))


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
        f"{recovery.world_before} -> {recovery.world_after}, {duration_text(recovery)} ({parts})"
    )


def duration_text(recovery: Recovery) -> str:
    """"2.3 s", plus "+ detection" when the fault's start was not seen and "+ start-up"
    when no worker reported training again (both are then missing from the time)."""
    text = f"{recovery.duration_s:.1f} s"
    text += "" if recovery.is_start_seen else " + detection"
    return text if recovery.is_end_seen else f"{text} + start-up"


def node_order(events: Sequence[Event]) -> list[str]:
    """Every node named in ``events``, in natural order (``n2`` before ``n10``)."""
    nodes = {e.node for e in events if e.node}
    nodes |= {str(e.metadata["lost"])
              for e in events if e.name == "node.lost" and e.metadata.get("lost")}  # fmt: skip
    return sorted(nodes, key=_natural)


def never_admitted(events: Sequence[Event]) -> set[str]:
    """Nodes that joined (registered) but no round ever listed as a member."""
    members = set().union(*(_members(e) for e in rounds_formed(events)))
    return {e.node for e in events if e.name == "node.joined" and e.node} - members


def job_end_ms(events: Sequence[Event]) -> int:
    """When the job ended: its last ``job.finished``, else the last event of all.

    Agents that were never admitted may report after that; they are not the job.
    """
    finished = [e.timestamp_ms for e in events if e.name == "job.finished"]
    return max(finished) if finished else events[-1].timestamp_ms


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
    formed = {e.round: e.timestamp_ms for e in rounds_formed(events)}
    lost_at: dict[int | None, int] = {r.round: r.start_ms for r in recoveries}
    rounds = sorted(rounds_formed(events), key=lambda e: e.timestamp_ms)
    overtaken = {e.round for e, following in zip(rounds, rounds[1:])
                 if _is_overtaken(events, e, following)}  # fmt: skip
    bars: dict[str, list[Bar]] = defaultdict(list)
    open_bar: dict[str, tuple[int, int | None]] = {}

    def close(node: str, at: int) -> None:
        if node in open_bar:
            start, number = open_bar.pop(node)
            if at > start:
                bars[node].append((start, at, number))

    for e in events:
        if e.name == "node.lost":
            node, died = str(e.metadata.get("lost")), lost_at.get(e.round, e.timestamp_ms)
            close(node, died)
            # Its last bars end where it died, not where the others noticed.
            bars[node] = [(s, min(end, died), n) for s, end, n in bars[node] if s < died]
        elif e.name == "round.formed" and e.source == "agent":
            for node in set(e.metadata.get("members", ())) & set(open_bar):
                close(node, e.timestamp_ms)
                if e.round not in overtaken:  # no worker ran in an overtaken round
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
