"""A round blocked on a hung peer is abandoned on notice, in real gloo processes.

torch 2.13's gloo ``abort()`` does not free a collective blocked on a SIGSTOPped peer,
and destroying the group would join that blocked thread. Here rank 2 stops itself while
ranks 0 and 1 wait in an all-reduce with a 10-minute timeout: the notice of a round
without it must end their wait at once, and after ``abandon_groups`` they must form the
next round's groups and restore state by broadcast in the same processes. Once the hung
peer is killed, its round's collectives fail, and the abandoned groups, their threads
with them, are released.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic_rt.layout import Layout
from elastic_rt.harness import wait_until
from elastic_rt.process_groups import (
    abandon_groups,
    abandoned_group_count,
    destroy_groups,
    init_groups,
    release_abandoned,
)
from elastic_rt.errors import RoundAbandoned
from elastic_rt.worker.abort import round_notice
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state
from elastic_rt.worker.trainers.replica_transfer import agree
from tests.fixtures.torchdist import (
    NOTICE_AFTER_S,
    TEN_MINUTES,
    WorkerEnv,
    loopback_round,
    run_workers,
)

pytestmark = pytest.mark.slow


def _form(env: WorkerEnv, layout: Layout, number: int):
    return init_groups(env.store, rank=env.rank, world_size=layout.world_size, layout=layout,
                       prefix=f"/elastic_rt/test/round-{number}/", timeout=TEN_MINUTES)


def _survive_a_hung_peer(env: WorkerEnv) -> dict[str, object]:
    groups = _form(env, Layout(dp=3), 0)
    dist.barrier(group=groups.world)
    if env.rank == 2:
        env.store.set("hung-pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # its sockets stay open: nothing fails
    notice = round_notice()
    notice.train_in(loopback_round(0, "a", "b", "c"))
    work = dist.all_reduce(torch.ones(4), group=groups.dp, async_op=True)
    assert work is not None
    # what the worker's round watch does when the agents evict the hung node
    threading.Timer(NOTICE_AFTER_S, notice.observe, args=(loopback_round(1, "a", "b"),)).start()
    began = time.monotonic()
    try:
        notice.wait(work.get_future())
        outcome = "completed"
    except RoundAbandoned:
        outcome = "abandoned"
    waited = time.monotonic() - began
    abandon_groups(groups)
    notice.train_in(loopback_round(1, "a", "b"))
    groups = _form(env, Layout(dp=2), 1)
    agreement = agree(10 if env.rank == 0 else 9, 0, groups.world)
    src, step = agreement.holders[0], agreement.step
    state = broadcast_state({"w": torch.arange(3.0) * (env.rank + 1), "step": step}, src,
                            groups.world)
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total, group=groups.world)
    destroy_groups(groups)
    held, threads = abandoned_group_count(), _threads()
    assert release_abandoned() == 0  # its all-reduce still waits on the hung peer
    if env.rank == 0:  # the hung node's agent would stop it once fenced
        os.kill(int(env.store.get("hung-pid")), signal.SIGKILL)
    wait_until(lambda: release_abandoned() >= 0 and abandoned_group_count() == 0, 30,
               "the abandoned round's collectives to fail")
    return {"outcome": outcome, "waited": waited, "src": src, "w": state["w"].tolist(),
            "step": state["step"], "sum": total.item(), "held": held,
            "threads_freed": threads - _threads()}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_round_blocked_on_a_hung_peer_is_abandoned_and_the_next_one_trains() -> None:
    results = run_workers(_survive_a_hung_peer, 3, timeout_s=90, may_die=frozenset({2}))
    assert results[2] is None
    for survivor in results[:2]:
        assert survivor["outcome"] == "abandoned"
        assert survivor["waited"] < NOTICE_AFTER_S + 5  # not the 10-minute timeout
        assert survivor["src"] == 0 and survivor["step"] == 10
        assert survivor["w"] == [0.0, 1.0, 2.0] and survivor["sum"] == 3.0
        assert survivor["held"] >= 2  # the world and the dp group at least
        # gloo's worker threads (two a group) and the blocked all-reduce's went with them
        assert survivor["threads_freed"] >= 2 * survivor["held"], survivor
