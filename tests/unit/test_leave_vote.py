"""The leave vote over a real gloo group: every rank learns at the same step boundary that
one node leaves, whichever rank saw its note, and whenever during the step it came."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_rt.worker.leave_vote import LeaveVote
from tests.fixtures.torchdist import WorkerEnv, run_workers

NOTE_AT = 3
"""Rank 2's note appears during step 3: it votes from step 4 on (it looks as a step begins)."""


def _vote(env: WorkerEnv) -> dict[str, object]:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    step = 0
    vote = LeaveVote(lambda: "SIGTERM" if env.rank == 2 and step > NOTE_AT else None)
    decided = []
    for step in range(1, 7):
        vote.begin(dist.group.WORLD)  # type: ignore[arg-type]
        grad = torch.ones(4)
        dist.all_reduce(grad)  # the step's own collective, after the vote
        decided.append(vote.anyone_leaves())
    dist.destroy_process_group()
    return {"decided": decided, "mine": vote.is_mine}


def test_every_rank_decides_at_the_same_boundary_and_only_the_leaver_is_it() -> None:
    results = run_workers(_vote, 3)
    expected = [False] * NOTE_AT + [True] * (6 - NOTE_AT)
    assert [r["decided"] for r in results] == [expected] * 3
    assert [r["mine"] for r in results] == [False, False, True]


def test_alone_the_note_decides_and_nothing_is_sent() -> None:
    notes = iter([None, "file:/run/preempted"])
    vote = LeaveVote(lambda: next(notes))
    vote.begin(None)
    assert not vote.anyone_leaves()
    vote.begin(None)
    assert vote.anyone_leaves() and vote.is_mine and vote.source == "file:/run/preempted"
