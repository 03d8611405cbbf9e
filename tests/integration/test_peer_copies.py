"""Peer copies are exchanged beside training, in real gloo processes, and never hold a step.

Two ranks (one per "node") swap snapshots of a piece along the ring with
``PeerCopies``. A snapshot must count only once its exchange has completed on this rank
(a refresh whose peer has not sent yet leaves the previous one), must be a copy (the step
that follows changes the live tensors), and must arrive whole (tensors of mixed dtypes); the
one before the newest stays until the next refresh reuses its buffer.
Then rank 1 hangs (SIGSTOP: its sockets stay open, nothing fails) while rank 0's exchange is
in flight: the next refresh must end on the round's notice, not the groups' 10-minute
timeout, with the state untouched; the last completed snapshot stays, and the copy group is
abandoned (torch's registry forgets it, so destroying the round's groups does not wait on
the blocked exchange).

On nodes of unequal sizes (ranks 0 and 1 on one node, rank 2 on another) the placement has
rank 2 hold two copies: one exchange sends each rank's piece and gives rank 2 both.
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


def _copy_then_hang(env: WorkerEnv) -> dict[str, object]:
    groups = init_groups(env.store, rank=env.rank, world_size=2, layout=Layout(dp=2),
                         prefix="/elastic_rt/test/round-0/", timeout=TEN_MINUTES)
    other = 1 - env.rank
    group = side_group(groups.world, TEN_MINUTES)
    assert group is not None
    copies = PeerCopies(group, Ring(to=other, sources=(other,), count=2, own_index=env.rank,
                                    peer_indices=(other,)), every=1)
    notice = round_notice()
    notice.train_in(loopback_round(0, "a", "b"))
    live = _piece(env.rank, 0)
    copies.refresh(0, live, {"step": 0})
    live["params"]["w"].add_(100.0)  # the step changes the live state in place
    wait_until(lambda: copies.completed, 30, "the first exchange")
    first = copies.completed[-1]
    own, peer = first.piece(env.rank), first.piece(other)
    # Views into the buffers the refresh after next reuses (that snapshot is gone by then).
    seen = {"own_w": own["params"]["w"].tolist(), "peer_w": peer["params"]["w"].tolist(),
            "peer_step": int(peer["optim_whole"]["step"]),
            "peer_flag": peer["optim_whole"]["flag"].tolist(), "peer_lr": peer["groups"][0]["lr"],
            "meta": first.meta}

    # Rank 1 refreshes late: until it does, rank 0's snapshot of step 1 has not arrived.
    if env.rank == 1:
        env.store.wait(["0-refreshed"])
    copies.refresh(1, _piece(env.rank, 1), {"step": 1})
    while_in_flight = [s.step for s in copies.completed]
    if env.rank == 0:
        env.store.set("0-refreshed", "1")
    wait_until(lambda: copies.completed[-1].step == 1, 30, "the second exchange")
    after_two = [s.step for s in copies.completed]

    dist.barrier(group=groups.world)
    if env.rank == 1:
        env.store.set("hung-pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # hangs before its third exchange
    env.store.wait(["hung-pid"])
    copies.refresh(2, _piece(env.rank, 2), {"step": 2})  # in flight, and it never ends
    while_hung = [s.step for s in copies.completed]  # step 0's buffer was reused
    # what the worker's round watch does when the agents evict the hung node
    threading.Timer(NOTICE_AFTER_S, notice.observe, args=(loopback_round(1, "a"),)).start()
    began = time.monotonic()
    try:
        copies.refresh(3, _piece(env.rank, 3), {"step": 3})  # first waits for step 2's
        outcome = "refreshed"
    except RoundAbandoned:
        outcome = "abandoned"
    waited = time.monotonic() - began
    kept = copies.close()
    registered = group in dist.distributed_c10d._world.pg_map
    abandon_groups(groups)
    os.kill(int(env.store.get("hung-pid")), signal.SIGKILL)  # its agent would stop it
    return {**seen, "in_flight": while_in_flight, "after_two": after_two,
            "while_hung": while_hung, "outcome": outcome, "waited": waited,
            "kept": [s.step for s in kept], "registered": registered}


def test_copies_count_once_complete_and_a_hung_peer_holds_no_step() -> None:
    results = run_workers(_copy_then_hang, 2, timeout_s=90, may_die=frozenset({1}))
    survivor = results[0]
    assert survivor is not None and results[1] is None
    assert survivor["own_w"] == [0.0, 1.0, 2.0]  # a copy: the step's change is not in it
    assert survivor["peer_w"] == [10.0, 11.0, 12.0] and survivor["peer_step"] == 0
    assert survivor["peer_flag"] == [True, False] and survivor["peer_lr"] == pytest.approx(0.1)
    assert survivor["meta"] == {"step": 0}
    assert survivor["in_flight"] == [0]  # step 1's copy had not arrived: step 0's counts
    assert survivor["after_two"] == [0, 1]  # the one before stays until its buffer is reused
    assert survivor["while_hung"] == [1]
    assert survivor["outcome"] == "abandoned"
    assert survivor["waited"] < NOTICE_AFTER_S + 5  # not the 10-minute timeout
    assert survivor["kept"] == [1]  # the last exchange that completed
    assert not survivor["registered"]  # abandoned: destroying the round's groups skips it


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
    wait_until(lambda: copies.completed, 30, "the exchange")
    snapshot = copies.completed[-1]
    held = {index: snapshot.piece(index)["params"]["w"].tolist()
            for index in (env.rank, *sources)}
    bytes_held = copies.host_bytes()
    copies.close()
    abandon_groups(groups)
    return {"holder": holders[env.rank], "held": held, "bytes": bytes_held,
            "holdings": [h.index for h in snapshot.holdings()]}


def test_a_rank_of_the_smaller_node_holds_the_copies_of_each_rank_of_the_larger() -> None:
    results = run_workers(_copy_on_unequal_nodes, 3, timeout_s=60)
    assert [r["holder"] for r in results] == [2, 2, 0]
    assert results[2]["held"] == {2: [20.0, 21.0, 22.0], 0: [0.0, 1.0, 2.0],
                                  1: [10.0, 11.0, 12.0]}
    assert results[0]["held"] == {0: [0.0, 1.0, 2.0], 2: [20.0, 21.0, 22.0]}
    assert results[1]["held"] == {1: [10.0, 11.0, 12.0]}  # it holds no copy
    assert results[2]["holdings"] == [2, 0, 1]
    # two copies held: two more pieces of host memory than a rank holding one
    assert results[2]["bytes"] > results[0]["bytes"] > results[1]["bytes"]
