"""Process groups built from a layout, in real gloo processes, re-formed round after round."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_rt.layout import Layout
from elastic_rt.accelerator import GLOO, MIXED
from elastic_rt.process_groups import abort_groups, destroy_groups, init_groups, pick_backend
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

TIMEOUT = timedelta(seconds=10)


def _allreduce_sum(value: float, group: dist.ProcessGroup) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, group=group)
    return tensor.item()


def _form(env: WorkerEnv, layout: Layout, round_: int, timeout: timedelta = TIMEOUT):
    return init_groups(
        env.store, rank=env.rank, world_size=layout.world_size, layout=layout,
        prefix=f"/elastic_rt/test/round-{round_}/", timeout=timeout,
    )


def _reform_three_then_two(env: WorkerEnv) -> list[float]:
    groups = _form(env, Layout(dp=3), 0)
    sums = [_allreduce_sum(env.rank + 1, groups.world)]
    destroy_groups(groups)
    if env.rank == 2:
        return sums  # this worker leaves; the other two form the next round without it
    groups = _form(env, Layout(dp=2), 1)
    sums.append(_allreduce_sum(env.rank + 1, groups.world))
    sums.append(_allreduce_sum(10 * (env.rank + 1), groups.dp))
    destroy_groups(groups)
    return sums


def test_groups_re_form_with_a_smaller_world_in_the_same_processes() -> None:
    results = run_workers(_reform_three_then_two, 3, timeout_s=60)
    assert results[0] == results[1] == [6.0, 3.0, 30.0]
    assert results[2] == [6.0]


def _axis_sums(env: WorkerEnv) -> dict[str, object]:
    layout = Layout(dp=2, pp=2)
    groups = _form(env, layout, 0)
    out: dict[str, object] = {
        axis: _allreduce_sum(2 ** env.rank, groups.axis(axis)) for axis in ("pp", "dp", "tp")
    }
    out["world"] = _allreduce_sum(2 ** env.rank, groups.world)
    out["mesh"] = groups.mesh.mesh.tolist()
    out["mesh_dp_ranks"] = dist.get_process_group_ranks(groups.mesh.get_group("dp"))
    destroy_groups(groups)
    return out


def test_each_axis_group_holds_the_ranks_the_layout_names() -> None:
    layout = Layout(dp=2, pp=2)
    results = run_workers(_axis_sums, 4, timeout_s=60)
    for rank, out in enumerate(results):
        for axis in ("pp", "dp", "tp"):
            assert out[axis] == sum(2 ** r for r in layout.group_ranks(axis, rank)), (rank, axis)
        assert out["world"] == 15
        assert out["mesh"] == [[[0], [1]], [[2], [3]]]
        assert out["mesh_dp_ranks"] == layout.group_ranks("dp", rank)


def _survive_a_dead_peer(env: WorkerEnv) -> list[float]:
    # Survivors notice the loss at different times: one at once (its socket to the dead peer
    # resets), another only when its collective times out. So the next round must wait for
    # peers longer than a collective waits for them.
    groups = _form(env, Layout(dp=3), 0, timeout=timedelta(seconds=2))
    _allreduce_sum(1, groups.world)
    if env.rank == 2:
        os._exit(0)  # a node dies without saying goodbye
    try:
        _allreduce_sum(1, groups.world)
        raise AssertionError("an allreduce with a dead peer succeeded")
    except RuntimeError:
        pass
    destroy_groups(groups)
    groups = _form(env, Layout(dp=2), 1, timeout=timedelta(seconds=20))
    result = [_allreduce_sum(env.rank + 1, groups.world)]
    destroy_groups(groups)
    return result


def test_survivors_destroy_broken_groups_and_form_new_ones() -> None:
    results = run_workers(_survive_a_dead_peer, 3, timeout_s=60, may_die=frozenset({2}))
    assert results == [[3.0], [3.0], None]


def _retry_after_a_round_that_never_formed(env: WorkerEnv) -> list[object]:
    try:
        _form(env, Layout(dp=2), 0, timeout=timedelta(seconds=1))  # the second rank never comes
    except RuntimeError as exc:  # c10d's DistStoreError is a RuntimeError
        failure = type(exc).__name__
    left_over = dist.is_initialized()
    groups = _form(env, Layout(dp=1), 1)
    result = [failure, left_over, _allreduce_sum(5, groups.world)]
    destroy_groups(groups)
    return result


def test_a_round_that_never_formed_leaves_nothing_behind() -> None:
    [(failure, left_over, total)] = run_workers(_retry_after_a_round_that_never_formed, 1)
    assert failure and not left_over and total == 5.0


def test_pick_backend_is_nccl_only_with_cuda() -> None:
    assert pick_backend() == (MIXED if torch.cuda.is_available() else GLOO)


def _abort_then_train_on(env: WorkerEnv) -> list[object]:
    groups = _form(env, Layout(dp=2), 0)
    aborted = abort_groups()  # a notice of a newer round; gloo groups are not NCCL's to abort
    result: list[object] = [aborted, _allreduce_sum(env.rank + 1, groups.dp)]
    destroy_groups(groups)
    groups = _form(env, Layout(dp=2), 1)
    result.append(_allreduce_sum(10 * (env.rank + 1), groups.world))
    destroy_groups(groups)
    return result


def test_aborting_on_notice_leaves_gloo_groups_working_and_reformable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # gloo groups on any machine (with CUDA they would be NCCL's, which
    # scripts/device_check.py checks); the workers inherit the setting.
    monkeypatch.setenv("ELASTIC_RT_BACKEND", "gloo")
    assert run_workers(_abort_then_train_on, 2, timeout_s=60) == [[0, 3.0, 30.0]] * 2


def _shard_twice_with_ranks_swapped(env: WorkerEnv) -> list[object]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    seen: list[object] = []
    for round_, rank in enumerate((env.rank, 1 - env.rank)):
        layout = Layout(dp=2, shard=2)
        groups = init_groups(env.store, rank=rank, world_size=2, layout=layout,
                             prefix=f"/elastic_rt/test/round-{round_}/", timeout=TIMEOUT)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 6)
        full = model.weight.detach().clone()
        fully_shard(model, mesh=groups.shard_mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # rows stay as they were
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()  # in-place DTensor ops: their specs come from DTensor's caches
        weight, moment = model.weight, optimizer.state[model.weight]["exp_avg"]
        assert isinstance(weight, DTensor) and isinstance(moment, DTensor)
        seen.append([rank, list(weight.device_mesh.get_coordinate() or ()),
                     list(moment.device_mesh.get_coordinate() or ()),
                     torch.equal(weight.to_local(), full.chunk(2)[rank])])
        destroy_groups(groups)
    return seen


def test_a_re_formed_round_that_moved_ranks_shards_by_the_new_ranks() -> None:
    """A rank that moved keeps no trace of its old number in its sharded state: DTensor
    caches specs by mesh equality, and the new round's mesh compares equal to the old one."""
    results = run_workers(_shard_twice_with_ranks_swapped, 2, timeout_s=60)
    for first in (0, 1):
        assert results[first] == [[first, [first], [first], True],
                                  [1 - first, [1 - first], [1 - first], True]], results


def _abandon_after_a_send(env: WorkerEnv) -> dict[str, float]:
    import psutil

    from elastic_rt.process_groups import abandon_groups, abandon_side_group, side_group

    def resident_mb() -> float:
        return psutil.Process().memory_info().rss / 2**20

    groups = _form(env, Layout(dp=2), 0)
    side = side_group(groups.world, TIMEOUT)
    assert side is not None
    before = resident_mb()
    copy = torch.ones(16 << 20)  # 64 MB: a peer copy's buffer, in small
    work = (dist.isend(copy, group=side, group_dst=1) if env.rank == 0
            else dist.irecv(copy, group=side, group_src=0))
    assert work is not None
    work.wait()
    summed = torch.ones(16 << 20)
    dist.all_reduce(summed, group=groups.world)
    del copy, summed, work
    listed = resident_mb() - before
    abandon_side_group(side)
    abandon_groups(groups)
    return {"listed": listed, "kept": resident_mb() - before}


def test_an_abandoned_group_lets_the_buffers_of_its_finished_work_go() -> None:
    for result in run_workers(_abandon_after_a_send, 2):
        # a group keeps its last collective's work until its next one, and gloo's work
        # keeps its 64 MB buffer (one of the two here)
        assert result["listed"] > 50, result
        assert result["kept"] < 30, result  # abandoned, it has no next one (68 MB before)
