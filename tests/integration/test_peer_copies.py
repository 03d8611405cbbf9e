"""Peer copies are sent beside training, in real gloo processes, and never hold a step.

Two ranks (one per "node") send each other snapshots of a piece with ``PeerCopies``. A
rank's own snapshot counts at once; a copy once it has arrived whole (tensors of mixed
dtypes, the sender's runtime state with it); a snapshot is a copy (the step that follows
changes the live tensors); the two newest of each piece are kept. A copy lands while its
holder is busy elsewhere (the holder's receive waits for it all round): rank 0's copy of step
1 reaches rank 1 before rank 1 has refreshed. Then rank 1 hangs (SIGSTOP: its sockets stay
open, nothing fails) while rank 0's send is in flight: the next refresh must end on the
round's notice, not the groups' 10-minute timeout, with the state untouched; the snapshots
and copies so far stay, and the copy group is abandoned (torch's registry forgets it, so
destroying the round's groups does not wait on the blocked send); the closed copies list
no buffer of their own, though the blocked send keeps them alive (at 1.2 GB of FSDP state
they held 1.6 GB per rank through the restore that followed).

On nodes of unequal sizes (ranks 0 and 1 on one node, rank 2 on another) the placement has
rank 2 hold two copies: each rank's piece is sent once, and rank 2 gets both.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_rt.harness import wait_until
from elastic_rt.layout import Layout
from elastic_rt.process_groups import abandon_groups, init_groups, side_group
from elastic_rt.errors import RoundAbandoned
from elastic_rt.worker.abort import round_notice
from elastic_rt.worker.trainers.copy_placement import copy_holders, held_for
from elastic_rt.worker.trainers.sharded.peer_copies import PeerCopies, Ring
from tests.fixtures.torchdist import (
    NOTICE_AFTER_S,
    TEN_MINUTES,
    WorkerEnv,
    loopback_round,
    run_workers,
)

pytestmark = pytest.mark.slow


def _piece(rank: int, step: int) -> dict[str, Any]:
    # float32 rows of odd size, then an int64 and a bool: packing must keep each aligned.
    return {"params": {"w": torch.arange(3.0) + 10 * rank + step},
            "optim_whole": {"step": torch.tensor(step, dtype=torch.int64),
                            "flag": torch.tensor([rank == 1, step > 0])},
            "groups": [{"lr": 0.1 * (step + 1)}]}


def _steps(copies: PeerCopies, index: int) -> list[int]:
    return [s.step for s in copies.completed if s.index == index]


def _piece_of(copies: PeerCopies, step: int, index: int) -> dict[str, Any]:
    return next(s.piece for s in copies.completed if s.step == step and s.index == index)


def _two_ranks(env: WorkerEnv) -> tuple[Any, dist.ProcessGroup, PeerCopies]:
    """A round of two ranks, each holding the other's copy, sent every step."""
    groups = init_groups(env.store, rank=env.rank, world_size=2, layout=Layout(dp=2),
                         prefix="/elastic_rt/test/round-0/", timeout=TEN_MINUTES)
    other = 1 - env.rank
    group = side_group(groups.world, TEN_MINUTES)
    assert group is not None
    return groups, group, PeerCopies(group, Ring(to=other, sources=(other,), count=2,
                                                 own_index=env.rank, peer_indices=(other,)),
                                     every=1)


def _copy_then_hang(env: WorkerEnv) -> dict[str, object]:
    groups, group, copies = _two_ranks(env)
    other = 1 - env.rank
    notice = round_notice()
    notice.train_in(loopback_round(0, "a", "b"))
    live = _piece(env.rank, 0)
    copies.refresh(0, live, {"step": 0, "rank": env.rank})
    live["params"]["w"].add_(100.0)  # the step changes the live state in place
    wait_until(lambda: _steps(copies, other), 30, "the first copy")
    own, peer = _piece_of(copies, 0, env.rank), _piece_of(copies, 0, other)
    # Views into the buffers the refresh after next reuses (that snapshot is gone by then).
    seen = {"own_w": own["params"]["w"].tolist(), "peer_w": peer["params"]["w"].tolist(),
            "peer_step": int(peer["optim_whole"]["step"]),
            "peer_flag": peer["optim_whole"]["flag"].tolist(), "peer_lr": peer["groups"][0]["lr"],
            "meta": next(s.meta for s in copies.completed if s.index == other)}

    # Rank 0 sends step 1 while rank 1 is busy elsewhere (it has not refreshed): the copy
    # must land on rank 1 all the same, its receive waiting for it the whole round.
    if env.rank == 0:
        copies.refresh(1, _piece(env.rank, 1), {"step": 1})
        before_peer = {"own": _steps(copies, 0), "held": _steps(copies, 1)}
        env.store.set("0-refreshed", "1")
    else:
        env.store.wait(["0-refreshed"])
        wait_until(lambda: _steps(copies, 0) == [0, 1], 30, "rank 0's copy of step 1")
        before_peer = {"own": _steps(copies, 1), "held": _steps(copies, 0)}
        copies.refresh(1, _piece(env.rank, 1), {"step": 1})
    wait_until(lambda: _steps(copies, other) == [0, 1], 30, "the copies of step 1")

    dist.barrier(group=groups.world)
    if env.rank == 1:
        env.store.set("hung-pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # hangs before its third refresh
    env.store.wait(["hung-pid"])
    copies.refresh(2, _piece(env.rank, 2), {"step": 2})  # in flight, and it never ends
    while_hung = {"own": _steps(copies, env.rank), "held": _steps(copies, other)}
    # what the worker's round watch does when the agents evict the hung node
    threading.Timer(NOTICE_AFTER_S, notice.observe, args=(loopback_round(1, "a"),)).start()
    began = time.monotonic()
    try:
        copies.refresh(3, _piece(env.rank, 3), {"step": 3})  # first waits for step 2's send
        outcome = "refreshed"
    except RoundAbandoned:
        outcome = "abandoned"
    waited = time.monotonic() - began
    kept = copies.close()
    left_bytes = copies.host_bytes()  # the send blocked on the hung peer keeps the object
    registered = group in dist.distributed_c10d._world.pg_map
    abandon_groups(groups)
    os.kill(int(env.store.get("hung-pid")), signal.SIGKILL)  # its agent would stop it
    return {**seen, "before_peer": before_peer, "while_hung": while_hung, "outcome": outcome,
            "waited": waited, "kept": sorted((s.index, s.step) for s in kept),
            "registered": registered, "left_bytes": left_bytes}


def test_copies_land_while_the_holder_is_busy_and_a_hung_peer_holds_no_step() -> None:
    results = run_workers(_copy_then_hang, 2, timeout_s=90, may_die=frozenset({1}))
    survivor = results[0]
    assert survivor is not None and results[1] is None
    assert survivor["own_w"] == [0.0, 1.0, 2.0]  # a copy: the step's change is not in it
    assert survivor["peer_w"] == [10.0, 11.0, 12.0] and survivor["peer_step"] == 0
    assert survivor["peer_flag"] == [True, False] and survivor["peer_lr"] == pytest.approx(0.1)
    assert survivor["meta"] == {"step": 0, "rank": 1}  # the sender's, with its piece
    # its own snapshot counts at once; rank 1's copy of step 1 has not been sent yet
    assert survivor["before_peer"] == {"own": [0, 1], "held": [0]}
    assert survivor["while_hung"] == {"own": [1, 2], "held": [0, 1]}  # two newest of each
    assert survivor["outcome"] == "abandoned"
    assert survivor["waited"] < NOTICE_AFTER_S + 5  # not the 10-minute timeout
    assert survivor["kept"] == [(0, 1), (0, 2), (1, 0), (1, 1)]
    assert not survivor["registered"]  # abandoned: destroying the round's groups skips it
    assert survivor["left_bytes"] == 0  # handed over: no buffer outlives them with the send


def _copy_on_unequal_nodes(env: WorkerEnv) -> dict[str, object]:
    groups = init_groups(env.store, rank=env.rank, world_size=3, layout=Layout(dp=3),
                         prefix="/elastic_rt/test/round-0/", timeout=TEN_MINUTES)
    holders = copy_holders(["a", "a", "b"])
    assert holders is not None
    sources = held_for(env.rank, holders)
    group = side_group(groups.world, TEN_MINUTES)
    assert group is not None
    copies = PeerCopies(group, Ring(to=holders[env.rank], sources=sources, count=3,
                                    own_index=env.rank, peer_indices=sources), every=1)
    copies.refresh(0, _piece(env.rank, 0), {"step": 0})
    wait_until(lambda: all(_steps(copies, source) for source in sources), 30, "the copies")
    held = {s.index: s.piece["params"]["w"].tolist() for s in copies.completed}
    bytes_held = copies.host_bytes()
    kept = copies.close()
    abandon_groups(groups)
    return {"holder": holders[env.rank], "held": held, "bytes": bytes_held,
            "kept": [s.holding().index for s in kept]}


def test_a_rank_of_the_smaller_node_holds_the_copies_of_each_rank_of_the_larger() -> None:
    results = run_workers(_copy_on_unequal_nodes, 3, timeout_s=60)
    assert [r["holder"] for r in results] == [2, 2, 0]
    assert results[2]["held"] == {2: [20.0, 21.0, 22.0], 0: [0.0, 1.0, 2.0],
                                  1: [10.0, 11.0, 12.0]}
    assert results[0]["held"] == {0: [0.0, 1.0, 2.0], 2: [20.0, 21.0, 22.0]}
    assert results[1]["held"] == {1: [10.0, 11.0, 12.0]}  # it holds no copy
    assert results[2]["kept"] == [2, 0, 1]
    # two copies held: two more pieces of host memory than a rank holding one
    assert results[2]["bytes"] > results[0]["bytes"] > results[1]["bytes"]


def _copies_in_turn(env: WorkerEnv) -> dict[str, object]:
    groups, _, copies = _two_ranks(env)
    other = 1 - env.rank
    places = []
    for step in range(5):
        copies.refresh(step, _piece(env.rank, step), {"step": step})
        wait_until(lambda: step in _steps(copies, other), 30, f"the copy of step {step}")
        places.append(_piece_of(copies, step, other)["params"]["w"].data_ptr())
        dist.barrier(group=groups.world)
    held = {s.step: s.piece["params"]["w"].tolist() for s in copies.completed if s.index == other}
    copies.close()
    abandon_groups(groups)
    return {"held": held, "places": places}


def test_a_copy_lands_in_the_buffer_of_the_one_it_pushed_out_with_its_own_values() -> None:
    for rank, result in enumerate(run_workers(_copies_in_turn, 2, timeout_s=60)):
        other = 10.0 * (1 - rank)
        assert result["held"] == {3: [other + 3, other + 4, other + 5],
                                  4: [other + 4, other + 5, other + 6]}
        places = result["places"]
        assert places[3] == places[0] and places[4] == places[1]  # no fresh pages a step
        assert len(set(places[:3])) == 3  # while two copies are kept, a third lands apart
