"""Pure verdicts of the soak over its event log: faults survived, re-forms, stalls.

Nothing here reads a file, a clock or a process, so each rule is unit-tested on
made-up logs (``tests/unit/test_soak_rules.py``). The lost/repeated-step audit and
the stale-write rule are the chaos matrix's (:mod:`elastic_rt.harness.chaos.audit`).

A fault is *survived* when the job went on past it (a step completed after it, or the
job finished), what could only be checked while injecting held (an exit code, etcd
healthy again), and a paused or cut-off node wrote nothing for a round it had been
dropped from. It went *as designed* when it also had the effect the design gives it:

=============  ==================================================================
node-kill      a later round leaves the node out
agent-leave    ``node.left`` and exit code 128+SIGTERM; a later round leaves it out
node-stop,     the node was dropped and fenced itself (``agent.fenced``) once back, and
netns-cut      rejoined a later round (or the job finished first)
worker-kill    its agent started the worker again (or the job finished first)
etcd-restart   the member was healthy again
node-join      the new node became a member of a round (or the job finished first)
=============  ==================================================================
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from elastic_rt.events import Event
from elastic_rt.harness.chaos.audit import stale_writes


@dataclass(frozen=True)
class Injection:
    """One fault as injected."""

    kind: str
    victim: str
    at_ms: int
    round: int
    """The newest round when it landed."""
    back_ms: int | None = None
    """When a node-stop or netns-cut ended (SIGCONT, link up)."""
    round_at_back: int | None = None
    ok: bool = True
    """What could only be checked while injecting held (an exit code, etcd healthy)."""
    detail: str = ""
    held_s: float = 0.0
    """How long it waited for a place to land (a replacement joining, a state holder)."""


@dataclass
class _Log:
    """The events a verdict needs, indexed once (a soak's log has ~10^5 lines)."""

    progress_ms: list[int]
    finished_ms: int | None
    rounds: list[Event]
    by_node: dict[str, list[Event]] = field(default_factory=dict)


def _index(events: list[Event]) -> _Log:
    steps: list[int] = []
    rounds: list[Event] = []
    by_node: dict[str, list[Event]] = {}
    finished: int | None = None
    for event in events:
        if event.name == "step.completed":
            steps.append(event.timestamp_ms)
            continue
        if event.name == "round.formed" and event.source == "agent":
            rounds.append(event)
        elif event.name == "job.finished" and finished is None:
            finished = event.timestamp_ms
        by_node.setdefault(event.node or "", []).append(event)
    return _Log(sorted(steps), finished, rounds, by_node)


@dataclass(frozen=True)
class Verdict:
    survived: bool
    as_designed: bool


def verdicts(injections: list[Injection], events: list[Event]) -> list[Verdict]:
    """Per injection, whether the job survived it and whether it went as designed."""
    log = _index(events)
    found = []
    for inj in injections:
        stale = (inj.kind in ("node-stop", "netns-cut") and bool(stale_writes(
            events, inj.victim, inj.round_at_back or inj.round, inj.back_ms or inj.at_ms)))
        alive = _went_on(inj, log) and inj.ok and not stale
        found.append(Verdict(alive, alive and _had_effect(inj, log)))
    return found


def _went_on(inj: Injection, log: _Log) -> bool:
    after = bisect.bisect_right(log.progress_ms, inj.back_ms or inj.at_ms)
    return after < len(log.progress_ms) or log.finished_ms is not None


def _had_effect(inj: Injection, log: _Log) -> bool:
    mine = log.by_node.get(inj.victim, [])
    finished = log.finished_ms is not None
    if inj.kind in ("node-kill", "agent-leave"):
        left = inj.kind == "node-kill" or any(e.name == "node.left" for e in mine)
        return left and (finished or _round_after(log, inj.at_ms, inj.victim, member=False))
    if inj.kind in ("node-stop", "netns-cut"):
        return _fenced_and_back(inj, log, mine)
    if inj.kind == "worker-kill":
        return finished or any(e.name == "worker.restarted" and e.timestamp_ms >= inj.at_ms
                               for e in mine)
    if inj.kind == "node-join":
        return finished or _round_after(log, inj.at_ms, inj.victim, member=True)
    return True  # etcd-restart: ``ok`` says it all


def _round_after(log: _Log, at_ms: int, node: str, *, member: bool) -> bool:
    """Whether a round formed at or after ``at_ms`` has ``node`` as a member (or not)."""
    return any((node in e.metadata.get("members", ())) is member
               for e in log.rounds if e.timestamp_ms >= at_ms)


def _fenced_and_back(inj: Injection, log: _Log, mine: list[Event]) -> bool:
    back = inj.back_ms if inj.back_ms is not None else inj.at_ms
    if log.finished_ms is not None and log.finished_ms < back:
        return True  # the others finished while it was out: nothing to fence or rejoin
    fenced = any(e.name == "agent.fenced" and e.timestamp_ms >= inj.at_ms for e in mine)
    rejoined = log.finished_ms is not None or _round_after(log, back, inj.victim, member=True)
    return fenced and rejoined


def longest_stall(events: list[Event]) -> tuple[float, int]:
    """The longest time no worker completed a step, in seconds, and the step that ended it
    (-1: none did; the log ends first, as in a job that hung).

    Recoveries cost a fraction of a second each; a stall of many seconds is a wait that
    a fault did not end (a join blocked on a dead peer, a hang until a timeout).
    """
    done = sorted((e.timestamp_ms, e.step or 0) for e in events if e.name == "step.completed")
    if not done:
        return 0.0, -1
    finished = any(e.name == "job.finished" for e in events)
    last_ms = max(e.timestamp_ms for e in events)
    gaps = [(b[0] - a[0], b[1]) for a, b in zip(done, done[1:])]
    if not finished:
        gaps.append((last_ms - done[-1][0], -1))
    gap_ms, step = max(gaps, default=(0, 0))
    return gap_ms / 1000, step


_PROVOKED_FOR_MS = 10_000
"""How long after a fault on a node (or its end) that node's eviction or fence is its doing."""


def unprovoked(injections: list[Injection], events: list[Event]) -> list[Event]:
    """Evictions and fences of nodes no fault had just hit: healthy nodes taken for dead
    (a starved agent's late answer, a watcher's own trouble), each costing a re-form."""
    hits: dict[str, list[tuple[int, int]]] = {}
    for inj in injections:
        if inj.kind not in ("node-join", "etcd-restart"):
            end = (inj.back_ms or inj.at_ms) + _PROVOKED_FOR_MS
            hits.setdefault(inj.victim, []).append((inj.at_ms, end))
    found = []
    for event in events:
        node = (event.metadata.get("evicted") if event.name == "node.evicted"
                else event.node if event.name == "agent.fenced" else None)
        if node is not None and not any(a <= event.timestamp_ms <= b
                                        for a, b in hits.get(str(node), ())):
            found.append(event)
    return found


def loss_gap(events: list[Event], reference: list[Event]) -> tuple[int, float]:
    """(steps compared, the largest difference) between the job's global loss at each step
    and the reference run's: the same training, step by step, also in a job that did not
    finish.

    The job's global loss is the mean of its ranks' ``loss`` in the newest round that
    completed the step (a rank that sat the step out reports none): the example's global
    batch of 12 splits evenly at any world size up to 4, so that is the batch mean. A step
    that not every rank of that round logged (a collective that ended on some ranks only,
    whose state went on from them) is not compared.
    """
    want = {e.step: e.metadata.get("loss") for e in reference if e.name == "step.completed"}
    by_step: dict[int, list[Event]] = {}
    for event in events:
        if event.name == "step.completed" and event.step is not None:
            by_step.setdefault(event.step, []).append(event)
    gaps = []
    for step, done in by_step.items():
        newest = max(e.round or 0 for e in done)
        ranks = [e for e in done if (e.round or 0) == newest]
        losses = [e.metadata["loss"] for e in ranks if e.metadata.get("loss") is not None]
        if losses and want.get(step) is not None and len(ranks) == ranks[0].metadata.get(
                "world_size", len(ranks)):
            gaps.append(abs(sum(losses) / len(losses) - want[step]))
    return len(gaps), max(gaps, default=0.0)
