"""The boundary vote over a real gloo group: every rank learns at the same step boundary that
one node leaves, or that a newer round is there, whichever rank saw it, and whenever
during the step it came."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_rt.worker.boundary_vote import BoundaryVote, Stop
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
