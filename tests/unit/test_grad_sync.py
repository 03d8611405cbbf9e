"""Gradient buckets over real gloo groups: the sum over uneven (and empty) shares is the
one-rank gradient of the global batch, reduction starts during backward, buckets go out
in the same order everywhere, a compressing hook plugs in, and a new round's buckets take
the old ones' place."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
import torch.distributed as dist

from elastic_rt.worker import grad_sync
from elastic_rt.worker.grad_sync import GradientBuckets, GradSync, bf16_compress
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers import runtime_step
from elastic_rt.worker.trainers.replicated import ReplicatedTrainer
from elastic_rt.worker.trainers.runtime_step import ReplicatedStep, StepOptions
from tests.fixtures.torchdist import WorkerEnv, run_workers

SAMPLES = 7  # split over 3 ranks as 3, 2, 2; over 8 ranks one rank gets nothing


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 1, generator=g)


def _share(rank: int, world: int) -> slice:
    base, extra = divmod(SAMPLES, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _reduce(env: WorkerEnv, options: GradSync, micro: int) -> dict[str, object]:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    model = _model()
    buckets = GradientBuckets(model, dist.group.WORLD, options)  # type: ignore[arg-type]
    launched_during_backward: list[int] = []
    first = next(model.parameters())  # its gradient comes last in backward
    first.register_post_accumulate_grad_hook(
        lambda _: launched_during_backward.append(buckets._next))
    x, y = _data()
    mine = _share(env.rank, env.nprocs)
    xs, ys = x[mine], y[mine]
    for step in range(2):  # the second step reuses the same buckets, zeroed
        buckets.zero_grad()
        chunks = list(zip(xs.split(micro), ys.split(micro))) if len(xs) else []
        for i, (cx, cy) in enumerate(chunks):
            buckets.begin(is_last_backward=i == len(chunks) - 1)
            loss = torch.nn.functional.mse_loss(model(cx), cy) * (len(cx) / SAMPLES)
            loss.backward()
        buckets.finish()
    grads = {name: _grad(p).clone() for name, p in model.named_parameters()}
    buckets.close()
    dist.destroy_process_group()
    return {"grads": grads, "launched": launched_during_backward,
            "buckets": len(buckets.buckets)}


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    x, y = _data()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {name: _grad(p) for name, p in model.named_parameters()}


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's gradient, which the backward above must have made."""
    assert param.grad is not None
    return param.grad


def test_uneven_shares_and_micro_batches_sum_to_the_global_batch_gradient() -> None:
    options = GradSync(bucket_cap_mb=0.01, first_bucket_mb=0.0002)  # several buckets
    results = run_workers(_reduce, 3, args=(options, 2))
    want = _reference()
    for result in results:
        assert result["buckets"] >= 3
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, want[name], atol=1e-6, rtol=0)
        # the last layers' buckets were on the wire before the first layer's gradient came
        assert result["launched"][-1] >= 1, result["launched"]


def test_a_rank_without_samples_joins_the_sum_with_zeros() -> None:
    results = run_workers(_reduce, 8, args=(GradSync(), 4), timeout_s=90)
    want = _reference()
    assert results[7]["launched"] == []  # it ran no backward at all
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, want[name], atol=1e-6, rtol=0)


def test_a_compressing_hook_reduces_within_bfloat16_precision() -> None:
    results = run_workers(_reduce, 2, args=(GradSync(comm_hook=bf16_compress), 8))
    want = _reference()
    for name, grad in results[0]["grads"].items():
        torch.testing.assert_close(grad, want[name], atol=1e-2, rtol=1e-2)
        assert not torch.equal(grad, want[name]) or grad.abs().max() == 0


def _reduce_with_a_branch(env: WorkerEnv) -> dict[str, object]:
    """Rank 0 never reaches ``extra``; rank 1 does. Two steps on the same buckets."""
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    torch.manual_seed(0)
    body, extra = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"body": body, "extra": extra})
    buckets = GradientBuckets(model, dist.group.WORLD, GradSync())  # type: ignore[arg-type]
    x = torch.ones(2, 4) * (env.rank + 1)
    for _ in range(2):
        buckets.zero_grad()
        buckets.begin(is_last_backward=True)
        out = body(x)
        loss = (extra(out).sum() if env.rank == 1 else out.sum())
        loss.backward()
        buckets.finish()
    in_buckets = all(any(p.grad.data_ptr() == v.data_ptr() for b in buckets.buckets
                         for v in b.views) for p in model.parameters() if p.grad is not None)
    grads = {name: _grad(p).clone() for name, p in model.named_parameters()}
    dist.destroy_process_group()
    return {"grads": grads, "in_buckets": in_buckets}


def test_a_parameter_one_rank_never_reached_gets_the_other_ranks_gradient() -> None:
    rank0, rank1 = run_workers(_reduce_with_a_branch, 2)
    assert rank0["in_buckets"] and rank1["in_buckets"]
    for name in rank0["grads"]:
        torch.testing.assert_close(rank0["grads"][name], rank1["grads"][name], atol=0, rtol=0)
    assert rank0["grads"]["extra.weight"].abs().sum() > 0  # rank 1's gradient, not zeros


def _rebind(env: WorkerEnv) -> dict[str, bool]:
    dist.init_process_group("gloo", store=env.store, rank=env.rank, world_size=env.nprocs)
    model = _model()
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    stepper = ReplicatedStep(state, lambda s, b: s.model(b).sum(), StepOptions())
    stepper.bind(dist.group.WORLD)  # type: ignore[arg-type]
    stepper.run([(torch.ones(2, 16), 2)], global_len=2, rank=env.rank, step=1)
    assert isinstance(stepper.buckets, GradientBuckets)
    kept = [bucket.buffer for bucket in stepper.buckets.buckets]
    trainer = ReplicatedTrainer(lambda _: state, lambda s, b: s.model(b).sum(), StepOptions())
    trainer.state, trainer.stepper = state, stepper
    trainer.release()  # as the loop does before every re-form: the group goes, not the buffers
    assert stepper.buckets.group is None
    stepper.bind(dist.group.WORLD)  # type: ignore[arg-type]  # a round after a clean one
    reused = [bucket.buffer for bucket in stepper.buckets.buckets] == kept
    # an abandoned round still runs a collective (a vote on a dead peer), none of the
    # buckets' own (the step stopped before it launched one): they serve the next round
    runtime_step.abandoned_group_count = lambda: 1  # type: ignore[attr-defined]
    stepper.release_group()
    stepper.bind(dist.group.WORLD)  # type: ignore[arg-type]
    reused_beside = [bucket.buffer for bucket in stepper.buckets.buckets] == kept
    del kept

    old = [weakref.ref(bucket.buffer) for bucket in stepper.buckets.buckets]
    alive_at_new: list[int] = []
    make = grad_sync._Bucket.__init__

    def counting(bucket: Any, params: list[torch.nn.Parameter]) -> None:
        gc.collect()
        alive_at_new.append(sum(ref() is not None for ref in old))
        make(bucket, params)

    grad_sync._Bucket.__init__ = counting  # type: ignore[method-assign, assignment]
    # a bucket's all-reduce of the abandoned round may still complete into the old buffers
    stepper.buckets._unsettled = [torch.futures.Future()]  # never completes
    stepper.release_group()
    stepper.bind(dist.group.WORLD)  # type: ignore[arg-type]  # the next round's
    return {"reused": reused, "reused beside an abandoned vote": reused_beside,
            "freed": alive_at_new == [0] * len(alive_at_new) and bool(alive_at_new)}


def test_buckets_serve_the_next_round_unless_an_abandoned_one_may_write_them() -> None:
    """A clean re-form keeps the buffers, and so does one after an abandoned round whose
    running collectives are none of the buckets'; after a bucket's all-reduce that has not
    finished, new buckets replace the old ones rather than double them."""
    assert run_workers(_rebind, 1) == [
        {"reused": True, "reused beside an abandoned vote": True, "freed": True}]
