"""The boundary vote over a real gloo group: every rank learns at the same step boundary that
one node leaves, or that a newer round is there, whichever rank saw it, and whenever
during the step it came; and that a save still being written on some rank holds a growth
(the loop's decision on the vote's outcome, tested as a unit)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_rt.errors import NewerRound
from elastic_rt.worker.boundary_vote import BoundaryVote, Stop
from elastic_rt.worker.loop import _ElasticLoop
from tests.fixtures.torchdist import WorkerEnv, run_workers

NOTE_AT = 3
"""Rank 2's note appears during step 3: it votes from step 4 on (it looks as a step begins)."""


def _vote(env: WorkerEnv) -> dict[str, object]:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    step = 0
    vote = BoundaryVote(lambda: "SIGTERM" if env.rank == 2 and step > NOTE_AT else None)
    decided = []
    for step in range(1, 7):
        # rank 0 alone has seen a newer round from step 5 on (its watch was quickest)
        newer = env.rank == 0 and step >= 5
        vote.begin(dist.group.WORLD, newer_round=newer)  # type: ignore[arg-type]
        grad = torch.ones(4)
        dist.all_reduce(grad)  # the step's own collective, after the vote
        decided.append(int(vote.outcome()))
    dist.destroy_process_group()
    return {"decided": decided, "mine": vote.is_mine}


def test_every_rank_decides_at_the_same_boundary_and_only_the_leaver_is_it() -> None:
    results = run_workers(_vote, 3)
    leave, both = int(Stop.LEAVE), int(Stop.LEAVE | Stop.NEWER_ROUND)
    expected = [0] * NOTE_AT + [leave] * (4 - NOTE_AT) + [both] * 2
    assert [r["decided"] for r in results] == [expected] * 3
    assert [r["mine"] for r in results] == [False, False, True]


def test_alone_the_note_decides_and_nothing_is_sent() -> None:
    notes = iter([None, "file:/run/preempted"])
    vote = BoundaryVote(lambda: next(notes))
    vote.begin(None, newer_round=False)
    assert vote.outcome() is Stop.NONE
    vote.begin(None, newer_round=True)
    assert vote.outcome() == Stop.LEAVE | Stop.NEWER_ROUND
    assert vote.is_mine and vote.source == "file:/run/preempted"


def _saving_vote(env: WorkerEnv) -> list[int]:
    """Rank 1 alone is still writing a save at steps 2-3; rank 0 sees a newer round from 2."""
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    vote = BoundaryVote(lambda: None)
    decided = []
    for step in range(1, 5):
        vote.begin(dist.group.WORLD,  # type: ignore[arg-type]
                   newer_round=env.rank == 0 and step >= 2, saving=env.rank == 1 and step in (2, 3))
        decided.append(int(vote.outcome()))
    dist.destroy_process_group()
    return decided


def test_one_ranks_save_in_flight_holds_every_rank_at_the_same_boundaries() -> None:
    newer, saving = int(Stop.NEWER_ROUND), int(Stop.NEWER_ROUND | Stop.SAVING)
    assert run_workers(_saving_vote, 2) == [[0, saving, saving, newer]] * 2


class _Checkpoint:
    async_save = True

    def __init__(self, every: int, writing: bool) -> None:
        self.every, self.is_writing = every, writing

    def should_save(self, step: int) -> bool:
        return step % self.every == 0


def _deciding(step: int, checkpoint: _Checkpoint | None) -> Any:
    return SimpleNamespace(progress=SimpleNamespace(step=step), checkpoint=checkpoint,
                           _growth_waits=0)


def test_a_growth_waits_for_a_save_then_joins_and_saves_every_step_cannot_hold_it() -> None:
    join = _ElasticLoop._join_newer_unless_saving
    loop = _deciding(40, _Checkpoint(every=10, writing=True))
    join(loop, Stop.NEWER_ROUND)  # the step-40 save began at this boundary: train on
    join(loop, Stop.NEWER_ROUND | Stop.SAVING)  # some rank still writes it
    assert loop._growth_waits == 2
    loop.progress.step = 42
    with pytest.raises(NewerRound):  # written everywhere
        join(loop, Stop.NEWER_ROUND)
    every_step = _deciding(7, _Checkpoint(every=1, writing=True))
    join(every_step, Stop.NEWER_ROUND)  # the first boundary only
    every_step.progress.step = 8
    with pytest.raises(NewerRound):
        join(every_step, Stop.NEWER_ROUND)
    with pytest.raises(NewerRound):  # no checkpoint: at once
        join(_deciding(3, None), Stop.NEWER_ROUND)
