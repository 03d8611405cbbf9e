"""Every collective on a round's gloo groups returns on the round's notice, whoever issued it.

The runtime waits on its own collectives through the notice; these are the ones it does
not issue: FSDP2's all-gathers (forward) and reduce-scatters (backward), a pipeline
schedule's send/recv (``torch.distributed.pipelining``), DTensor's redistribution
(functional collectives, waited on from C++) and a plain ``dist.all_reduce`` from user
code. Three gloo ranks with a 10-minute collective timeout: rank 2 hangs (it never
enters the collective, its sockets stay open, as a SIGSTOPped peer's do), the notice of a
round without it comes 0.3 s later, and ranks 0 and 1 must be out of the collective with
``RoundAbandoned`` at once; then all three form the next round in the same processes.
Without ``noticed_gloo`` each wait here lasts the 10 minutes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Shard, distribute_tensor

from elastic_rt.errors import RoundAbandoned
from elastic_rt.etcd_server import free_port
from elastic_rt.harness import PYTHON, REPO, child_env
from elastic_rt.layout import Layout
from elastic_rt.noticed_gloo import NoticedGloo
from elastic_rt.process_groups import Groups, abandon_groups, destroy_groups, init_groups
from elastic_rt.worker.abort import round_notice
from tests.fixtures.processes import ProcessTree
from tests.fixtures.torchdist import (
    NOTICE_AFTER_S,
    TEN_MINUTES,
    WorkerEnv,
    loopback_round,
    run_workers,
)

pytestmark = pytest.mark.slow

HUNG = 2


def _user_all_reduce(groups: Groups) -> None:
    dist.all_reduce(torch.ones(8), group=groups.world)


def _dtensor_gather(groups: Groups) -> None:
    assert groups.shard_mesh is not None
    distribute_tensor(torch.arange(12.0), groups.shard_mesh, [Shard(0)]).full_tensor()


def _fsdp_model(groups: Groups) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
    for layer in model:
        fully_shard(layer, mesh=groups.shard_mesh)
    fully_shard(model, mesh=groups.shard_mesh)
    return model


def _fsdp_forward(groups: Groups) -> None:
    _fsdp_model(groups)(torch.ones(2, 16))


def _fsdp_backward(groups: Groups) -> None:
    model = _fsdp_model(groups)
    loss = model(torch.ones(2, 16)).sum()
    groups.world.barrier().wait()  # all three ran the forward; the hung one stops here
    loss.backward()


def _pipeline(groups: Groups) -> None:
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(8, 8), groups.rank, groups.world.size(),
                          torch.device("cpu"), group=groups.world)
    schedule = ScheduleGPipe(stage, n_microbatches=2,
                             loss_fn=lambda out, target: (out - target).pow(2).mean())
    if groups.rank == 0:
        schedule.step(torch.ones(4, 8))
    else:
        schedule.step()


KINDS: dict[str, Callable[[Groups], None]] = {
    "user all_reduce": _user_all_reduce,
    "DTensor full_tensor": _dtensor_gather,
    "FSDP forward": _fsdp_forward,
    "FSDP backward": _fsdp_backward,
    "pipeline GPipe": _pipeline,
}


def _form(env: WorkerEnv, number: int, store: dist.Store | None = None) -> Groups:
    return init_groups(store or env.store, rank=env.rank, world_size=3,
                       layout=Layout(dp=3, shard=3), prefix=f"/elastic_rt/test/round-{number}/",
                       timeout=TEN_MINUTES)


def _client(env: WorkerEnv) -> dist.TCPStore:
    """A client of the test's store of its own (one client blocked in a wait blocks every
    other call on it)."""
    store = env.store
    assert isinstance(store, dist.TCPStore)
    return dist.TCPStore(store.host, store.port, is_master=False, timeout=TEN_MINUTES)


def _abandon_each_kind(env: WorkerEnv) -> dict[str, object]:
    notice = round_notice()
    outcomes: dict[str, object] = {}
    for number, (kind, collective) in enumerate(KINDS.items()):
        # the worker's order (joined_round.join): the new round is ours before its groups
        # connect, or the last round's notice would abandon them as they connect
        notice.train_in(loopback_round(number, "a", "b", "c"))
        groups = _form(env, number)
        assert isinstance(groups.world, NoticedGloo) and isinstance(groups.dp, NoticedGloo)
        if env.rank == HUNG:
            if kind == "FSDP backward":  # it takes part in the forward, then hangs
                _fsdp_model(groups)(torch.ones(2, 16))
                groups.world.barrier().wait()
            env.store.wait([f"abandoned-{number}-0", f"abandoned-{number}-1"])
            abandon_groups(groups)
            continue
        # what the worker's round watch does when the agents evict the hung node
        threading.Timer(NOTICE_AFTER_S, notice.observe,
                        args=(loopback_round(number + 1, "a", "b"),)).start()
        began = time.monotonic()
        try:
            collective(groups)
            outcome = "completed"
        except RoundAbandoned:
            outcome = "abandoned"
        outcomes[kind] = {"outcome": outcome, "waited": time.monotonic() - began}
        abandon_groups(groups)
        env.store.set(f"abandoned-{number}-{env.rank}", "1")
    # the next round, the hung rank back in it, trains in the same processes
    notice.train_in(loopback_round(len(KINDS), "a", "b", "c"))
    groups = _form(env, len(KINDS))
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total, group=groups.world)
    destroy_groups(groups)
    return {"kinds": outcomes, "sum": total.item()}


def test_every_collective_on_a_round_notice_returns_whoever_issued_it() -> None:
    results = run_workers(_abandon_each_kind, 3, timeout_s=120)
    for survivor in results[:HUNG]:
        assert survivor["kinds"].keys() == KINDS.keys()
        for kind, seen in survivor["kinds"].items():
            assert seen["outcome"] == "abandoned", kind
            # not the 10-minute timeout: the notice, seen within a slice
            assert NOTICE_AFTER_S - 0.05 < seen["waited"] < NOTICE_AFTER_S + 2.0, (kind, seen)
    assert [r["sum"] for r in results] == [6.0] * 3


def _abandon_a_round_while_it_forms(env: WorkerEnv) -> dict[str, object]:
    """Rank 2 never builds round 0's groups (it died as the round formed): gloo's
    constructor waits for it to connect, and only the notice may end that wait.

    Each round has a store client of its own, as in the loop (``join_round_store``): the
    abandoned constructor stays blocked in its client's wait for the missing peer."""
    notice = round_notice()
    notice.train_in(loopback_round(0, "a", "b", "c"))
    seen: dict[str, object] = {}
    if env.rank == HUNG:
        env.store.wait(["formed-0", "formed-1"])
    else:
        threading.Timer(NOTICE_AFTER_S, notice.observe,
                        args=(loopback_round(1, "a", "b"),)).start()
        began = time.monotonic()
        try:
            abandon_groups(_form(env, 0, store=_client(env)))
            seen["outcome"] = "formed"
        except RoundAbandoned:
            seen["outcome"] = "abandoned"
        seen["waited"] = time.monotonic() - began
        env.store.set(f"formed-{env.rank}", "1")
    notice.train_in(loopback_round(2, "a", "b", "c"))
    groups = _form(env, 2, store=_client(env))  # the next round forms in the same processes
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total, group=groups.world)
    destroy_groups(groups)
    return {**seen, "sum": total.item()}


def test_a_round_that_loses_a_peer_while_its_groups_form_is_abandoned_on_notice() -> None:
    results = run_workers(_abandon_a_round_while_it_forms, 3, timeout_s=120)
    for survivor in results[:HUNG]:
        assert survivor["outcome"] == "abandoned"
        assert survivor["waited"] < NOTICE_AFTER_S + 2.0, survivor  # not the 10 minutes
    assert [r["sum"] for r in results] == [6.0] * 3


def test_a_process_exits_cleanly_with_a_send_or_recv_of_an_abandoned_round_still_blocked(
    process_tree: ProcessTree, tmp_path: Path
) -> None:
    """A job's workers exit together at its end; one whose abandoned round still waits on a
    recv from another used to abort (SIGABRT) when that peer's exit freed the wait while
    the interpreter finalized. Deterministic: the peer leaves just then (the fixture)."""
    port = free_port()
    fixture = [PYTHON, "-m", "tests.fixtures.exit_with_blocked_p2p"]
    ranks = [process_tree.start([*fixture, str(rank), str(port), str(tmp_path)], env=child_env(),
                                log=tmp_path / f"rank{rank}.log", cwd=REPO)
             for rank in range(2)]
    codes = [rank.wait(timeout=60) for rank in ranks]
    output = (tmp_path / "rank1.log").read_text()
    assert (tmp_path / "rank1-finalizing").exists(), output  # the peer did leave just then
    assert codes == [0, 0], output
    assert "terminate called" not in output
