"""Pure pass/fail decisions of the chaos matrix, over event logs and counts.

Nothing here reads a file, a clock or a process: :func:`audit_steps` and
:func:`stale_writes` judge lists of :class:`~elastic_rt.events.Event`, and
:class:`TrialResult` says whether a trial met the bar (100 % and zeros), so each
rule is unit-tested on made-up logs (``tests/unit/test_chaos_audit.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_rt.events import Event


@dataclass(frozen=True)
class TrialResult:
    """What one fault injection showed."""

    fault: str
    trial: int
    seconds: float
    finished: bool
    params_equal: bool
    lost: int
    repeated: int
    damaged: int
    orphans: int
    problems: tuple[str, ...]
    checks: tuple[str, ...]
    skipped: str = ""
    redone: int = 0
    """Steps trained again because the state that did them died (work lost, not samples)."""

    @property
    def passed(self) -> bool:
        return (not self.skipped and self.finished and self.params_equal and not self.problems
                and self.lost == self.repeated == self.damaged == self.orphans == 0)


def audit_steps(events: list[Event], steps: int) -> tuple[int, int, int]:
    """(steps lost, steps repeated, steps redone) along the lineage of rank 0's steps.

    Events are read in file order (appends are atomic, so that is the true order).
    The lineage is a stack: a completed step ``s`` pops every step ``>= s`` — work
    that was undone by a recovery. Undoing is legitimate only when the state that
    did it is gone: its node is not in the round that redoes it, or that node's
    workers were restarted or fenced since. Otherwise the step counts as repeated.
    A gap in the lineage, or a final step short of ``steps``, counts as lost,
    unless another rank completed those steps: a survivor that finished a step
    rank 0 did not (a collective can end on some ranks only) hands its state on.
    Legitimately undone steps are counted as redone: work lost, not samples.
    A completion by the rank 0 of a round older than one rank 0 already completed a
    step in is no part of the lineage: it is logged late, by a worker that was paused
    or cut off mid-step, whose round the others had left (:func:`stale_writes` judges
    whether it trained on alone).
    """
    members: dict[int, tuple[str, ...]] = {}
    state_lost_at: dict[str, list[int]] = {}
    lineage: list[tuple[int, int, str]] = []  # (step, event index, node)
    lost = repeated = redone = 0
    done_anywhere: set[int] = set()
    newest = -1
    for index, event in enumerate(events):
        if event.name == "round.formed" and event.source == "agent" and event.round is not None:
            members[event.round] = tuple(event.metadata.get("members", ()))
        elif event.name in ("worker.started", "worker.restarted", "agent.fenced"):
            state_lost_at.setdefault(event.node or "", []).append(index)
        if event.name == "step.completed" and event.step is not None:
            done_anywhere.add(event.step)
        if event.name != "step.completed" or event.rank != 0 or event.step is None:
            continue
        if event.round is not None:
            if event.round < newest:
                continue
            newest = event.round
        while lineage and lineage[-1][0] >= event.step:
            _, done_at, node = lineage.pop()
            gone = node not in members.get(event.round if event.round is not None else -1, (node,))
            restarted = any(done_at < i < index for i in state_lost_at.get(node, ()))
            if gone or restarted:
                redone += 1
            else:
                repeated += 1
        expected = lineage[-1][0] + 1 if lineage else 1
        lost += sum(s not in done_anywhere for s in range(expected, event.step))
        lineage.append((event.step, index, event.node or ""))
    final = lineage[-1][0] if lineage else 0
    return lost + max(0, steps - final), repeated, redone


def stale_writes(events: list[Event], victim: str, current: int, since_ms: int) -> list[Event]:
    """What the victim's old workers did for an old round after they woke up.

    A checkpoint commit is always stale. A step completed in an old round is stale
    only when no other node completed it in that round: a step whose collective
    finished just before the pause is logged late, not trained on alone. Nor is one
    whose collective the others abandoned when the victim was evicted (``step.retried``
    with ``RoundAbandoned``, see ``worker/abort.py``): their abandoned work still holds
    that step's contributions, so the victim's late completion sums every rank's share,
    and it can commit nothing (the round's token is stale).
    """
    done_by_others = {(e.round, e.step) for e in events if e.node != victim and (
        e.name == "step.completed"
        or (e.name == "step.retried" and e.metadata.get("error") == "RoundAbandoned"))}
    return [e for e in events
            if e.node == victim and e.source == "worker" and e.timestamp_ms > since_ms
            and e.round is not None and e.round < current
            and (e.name == "checkpoint.committed"
                 or (e.name == "step.completed" and (e.round, e.step) not in done_by_others))]
