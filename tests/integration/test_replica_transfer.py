"""A replicated restore over real gloo processes: nothing moves where nothing must, and a
join streams while the holders train.

Three ranks train the same AdamW model (a scheduler, extras, one transposed and so
non-contiguous parameter) for three steps from a fresh start. Restored again, all three
hold the same state: nothing moves and nothing is touched. Then rank 2 is replaced by a
newcomer (built, never stepped, empty AdamW state) while ranks 0 and 1 train two steps
more. The newcomer's restore returns at once; the holders then train the next step on the
whole batch while the state streams, in chunks small enough that many go each way (shared
by the holders), and the newcomer sits it out. After that step all three are bitwise equal
(model, optimizer with its step counts, the scheduler's learning rate, TrainMeta) and
equal to that step taken in one process. In the second test a holder dies mid-stream: the
survivors re-form, the holder that is left still holds the step before (its update waited
for the stream) and streams again, and the two end equal. A rank one step behind keeps its
own state until the newer one has landed, and trains no sample in that step (the last).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_rt.config import STREAM_OVER_TCP_ENV
from elastic_rt.errors import RoundAbandoned
from elastic_rt.harness import wait_until
from elastic_rt.layout import Layout
from elastic_rt.noticed_gloo import NoticedGloo
from elastic_rt.process_groups import abandon_groups, destroy_groups, init_groups
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers import Progress, Restoring, StepOptions
from elastic_rt.worker.trainers.protocol import Restored
from elastic_rt.worker.abort import round_notice
from elastic_rt.worker.trainers.replica_state import named_tensors
from elastic_rt.worker.trainers.replica_transfer import WINDOW, Agreement, Stream
from elastic_rt.worker.trainers.replicated import ReplicatedTrainer
from elastic_rt.worker.trainers.tcp_stream import open_links
from tests.fixtures.meta_paths import TIMEOUT, _context
from tests.fixtures.torchdist import (
    NOTICE_AFTER_S,
    TEN_MINUTES,
    WorkerEnv,
    loopback_round,
    run_workers,
)

pytestmark = pytest.mark.slow

CHUNK_BYTES = 96
"""So that each tensor of the model goes in several chunks."""
_BUFFERS = {f"model.norm.{name}" for name in ("running_mean", "running_var",
                                              "num_batches_tracked")}
"""Written by each holder's forward on its own share: they leave as they were before it."""
LATE_CHUNKS = 16
"""Chunks of 1 KiB in the late-bytes test's state: more than a receiver posts at once."""


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 64)
        self.wide = torch.nn.Linear(64, 64)  # ~50 KB of state with AdamW: ~500 chunks
        self.second = torch.nn.Linear(64, 3)
        self.mix = torch.nn.Parameter(torch.randn(3, 6).t())  # non-contiguous, so is exp_avg
        self.norm = torch.nn.BatchNorm1d(64)  # buffers the holders' forward writes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.relu(self.wide(torch.relu(self.first(x)))))
        return self.second(hidden) + (x @ self.mix)


_BUILDS = [0]
"""Calls of _build in this process."""


def _build(layout: Layout) -> TrainState:
    _BUILDS[0] += 1
    torch.manual_seed(0)  # every rank builds the same model
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, extras={"n": 0})


_ENTERED: list[float] = []
"""When this process's step function was first called (time.monotonic, shared by processes)."""


def _step(state: TrainState, batch: Any) -> torch.Tensor:
    _ENTERED.append(time.monotonic())
    return state.model(batch).pow(2).mean()


def _streamed_step(trainer: ReplicatedTrainer, ctx: Any, progress: Progress,
                   sampler: ElasticSampler, restored: Restored, *, step: int) -> float | None:
    """The step the newcomer's state lands in, as the loop trains it: the ranks not
    sitting out split the global batch; when this rank's last byte arrived."""
    batch = _batch(step)
    rank = ctx.groups.world.rank()
    training = [r for r in range(ctx.groups.world.size()) if r not in restored.sitting_out]
    share = [(batch[i::len(training)], len(batch) // len(training))
             for i, r in enumerate(training) if r == rank]
    stream = trainer.stream
    trainer.train(share, global_len=len(batch), ctx=ctx, step=step)
    sampler.advance()
    progress.step += 1
    return None if stream is None else stream.began + (stream.seconds or 0.0)


def _batch(step: int) -> torch.Tensor:
    """A streamed step's global batch: 3 samples a rank for the 2 holders that train it, the
    newcomer sitting out (BatchNorm needs 2)."""
    torch.manual_seed(100 + step)
    return torch.randn(6, 6)


def _one_process_step(state: TrainState, training: int, step: int) -> dict[str, torch.Tensor]:
    """The streamed step as one process takes it: each of ``training`` shares through the
    model on its own (BatchNorm normalizes by a share's statistics), the losses weighted
    by their part of the batch and summed."""
    batch = _batch(step)
    for i in range(training):
        (state.model(batch[i::training]).pow(2).mean() / training).backward()
    state.optimizer.step()
    assert state.scheduler is not None
    state.scheduler.step()
    return {name: t.detach().clone() for name, t in named_tensors(state)}


def _train(state: TrainState, sampler: ElasticSampler, progress: Progress, steps: int) -> None:
    """Steps every holder takes alike (seeded by the step), as data parallelism would."""
    for _ in range(steps):
        torch.manual_seed(progress.step)
        state.model(torch.randn(4, 6)).pow(2).mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        assert state.scheduler is not None
        state.scheduler.step()
        state.extras["n"] += 1
        sampler.advance()
        progress.step += 1


def _held(trainer: ReplicatedTrainer, progress: Progress,
          sampler: ElasticSampler) -> dict[str, Any]:
    assert trainer.state is not None
    meta = trainer.checkpoint_meta(step=progress.step, sampler=sampler).encode()
    return {"tensors": {name: t.detach().clone() for name, t in named_tensors(trainer.state)},
            "strided": [name for name, t in named_tensors(trainer.state)
                        if not t.is_contiguous()],
            "groups": json.dumps(trainer.state.optimizer.state_dict()["param_groups"]),
            "meta": json.dumps(meta, sort_keys=True), "step": progress.step}


def _restore(trainer: ReplicatedTrainer, ctx: Any, progress: Progress,
             sampler: ElasticSampler) -> Restored:
    trainer.release()
    return trainer.restore(Restoring(ctx=ctx, checkpoint=None, sampler=sampler,
                                     progress=progress))


def _said(restored: Restored) -> list[Any]:
    return [restored.source, restored.bytes_moved]


def _kill_then_join(env: WorkerEnv) -> dict[str, Any]:
    ctx = _context(env, Layout(dp=env.nprocs), "/replica/")
    try:
        def fresh() -> tuple[ReplicatedTrainer, Progress, ElasticSampler]:
            trainer = ReplicatedTrainer(_build, _step, StepOptions(), chunk_bytes=CHUNK_BYTES)
            return trainer, Progress(), ElasticSampler(64, global_batch_size=4, seed=0)

        trainer, progress, sampler = fresh()
        _restore(trainer, ctx, progress, sampler)  # a fresh start: every rank alike
        assert trainer.state is not None
        _train(trainer.state, sampler, progress, 3)
        before = _held(trainer, progress, sampler)
        pointers = [t.data_ptr() for _, t in named_tensors(trainer.state)]
        kept = _restore(trainer, ctx, progress, sampler)  # as after a node kill
        after = _held(trainer, progress, sampler)
        untouched = (pointers == [t.data_ptr() for _, t in named_tensors(trainer.state)]
                     and all(torch.equal(after["tensors"][n], t)
                             for n, t in before["tensors"].items()))
        if env.rank == 2:
            trainer, progress, sampler = fresh()  # a newcomer in its place, built ahead
            trainer.prepare(ctx.layout)  # the layout of its round: kept
            prepared = trainer.state
        else:
            _train(trainer.state, sampler, progress, 2)  # type: ignore[arg-type]
        buffers = {n: t.detach().clone() for n, t in named_tensors(trainer.state)
                   if n in _BUFFERS} if trainer.state is not None else {}
        builds = _BUILDS[0]
        joined = _restore(trainer, ctx, progress, sampler)
        returned_at = time.monotonic()
        kept_prepared = env.rank != 2 or (trainer.state is prepared
                                          and _BUILDS[0] == builds)
        dirty_while_streaming = progress.is_dirty
        assert trainer.state is not None
        reference = (_one_process_step(copy.deepcopy(trainer.state), 2, step=6)
                     if env.rank == 0 else {})
        landed = _streamed_step(trainer, ctx, progress, sampler, joined, step=6)
        return {"kept": _said(kept), "untouched": untouched, "joined": _said(joined),
                "receiving": joined.receiving, "sitting_out": joined.sitting_out,
                "reference": reference,
                "returned_at": returned_at, "kept_prepared": kept_prepared, "landed": landed,
                "entered": _ENTERED[-1:],
                "dirty": [dirty_while_streaming, progress.is_dirty], "buffers_before": buffers,
                **_held(trainer, progress, sampler)}
    finally:
        destroy_groups(ctx.groups)


def test_survivors_move_nothing_and_a_newcomer_gets_the_holders_state_while_they_train() -> None:
    results = run_workers(_kill_then_join, 3, timeout_s=90)
    for got in results:
        assert got["kept"] == ["kept", 0] and got["untouched"]
    holder, newcomer = results[0], results[2]
    assert newcomer["step"] == holder["step"] == 6
    # the holders' forward ran while the newcomer's bytes were still arriving; the
    # newcomer sat that step out: its step function did not run after its restore
    assert newcomer["landed"] > holder["entered"][0] > holder["returned_at"]
    assert all(t < newcomer["returned_at"] for t in newcomer["entered"])
    assert all((got["receiving"], got["sitting_out"]) == ((2,), (2,)) for got in results)
    assert newcomer["dirty"] == [True, False]
    assert newcomer["kept_prepared"]  # built before the round, not again in it
    assert newcomer["tensors"].keys() == holder["tensors"].keys()
    for name, tensor in holder["tensors"].items():
        if name in _BUFFERS:  # the holders' forward wrote theirs; the newcomer sat out
            continue
        assert torch.equal(newcomer["tensors"][name], tensor), name
        assert torch.equal(results[1]["tensors"][name], tensor), name
        torch.testing.assert_close(tensor, holder["reference"][name], atol=1e-6, rtol=0,
                                   msg=name)
    tracked = "model.norm.num_batches_tracked"
    assert newcomer["tensors"][tracked] == holder["buffers_before"][tracked]  # the step before
    assert holder["tensors"][tracked] == holder["buffers_before"][tracked] + 1
    assert any(name.endswith(".step") for name in holder["tensors"])
    # staged: the holders' strided moment, and the newcomer's strided parameter (its
    # moments are allocated contiguous, so they are received in place)
    assert {"model.mix", "optimizer.0.exp_avg"} <= set(holder["strided"])
    assert "model.mix" in newcomer["strided"]
    assert newcomer["groups"] == holder["groups"] and newcomer["meta"] == holder["meta"]
    total = sum(t.numel() * t.element_size() for t in holder["tensors"].values())
    sent = [results[0]["joined"][1], results[1]["joined"][1]]
    assert newcomer["joined"] == ["ranks 0,1", total]
    assert sum(sent) == total and all(abs(s - total / 2) <= 2 * CHUNK_BYTES for s in sent)
    assert total > 20 * CHUNK_BYTES  # many chunks each way


def _killed_mid_stream(env: WorkerEnv) -> dict[str, Any]:
    """Rank 2 joins as above; holder 1 dies in the step that streams to it."""
    ctx = _context(env, Layout(dp=env.nprocs), "/stream/")
    trainer = ReplicatedTrainer(_build, _step, StepOptions(), chunk_bytes=CHUNK_BYTES)
    progress, sampler = Progress(), ElasticSampler(64, global_batch_size=4, seed=0)
    _restore(trainer, ctx, progress, sampler)
    if env.rank < 2:
        assert trainer.state is not None
        _train(trainer.state, sampler, progress, 3)
    else:
        trainer, progress = ReplicatedTrainer(_build, _step, StepOptions(),
                                              chunk_bytes=CHUNK_BYTES), Progress()
        trainer.prepare(Layout(dp=2))  # a wrong guess of its round's layout: built again
    builds = _BUILDS[0]
    streaming = _restore(trainer, ctx, progress, sampler)
    rebuilt = _BUILDS[0] - builds
    assert trainer.stream is not None
    if env.rank == 1:  # dies as its forward begins, its share of the stream half sent
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        _streamed_step(trainer, ctx, progress, sampler, streaming, step=4)
        raise AssertionError("the step whose stream broke completed")
    except RuntimeError as exc:
        failed = type(exc).__name__
    finally:
        trainer.release()
        abandon_groups(ctx.groups)
    after_failure = {"step": progress.step, "dirty": progress.is_dirty}
    rank = {0: 0, 2: 1}[env.rank]  # the survivors re-form, the newcomer second
    groups = init_groups(env.store, rank=rank, world_size=2, layout=Layout(dp=2),
                         prefix="/stream-again/", timeout=TIMEOUT)
    ctx = dataclasses.replace(ctx, rank=rank, world_size=2, layout=Layout(dp=2), groups=groups)
    try:
        again = _restore(trainer, ctx, progress, sampler)
        _streamed_step(trainer, ctx, progress, sampler, again, step=4)
        return {"failed": failed, "after_failure": after_failure, "again": _said(again),
                "rebuilt": rebuilt,
                **_held(trainer, progress, sampler)}
    finally:
        destroy_groups(groups)


def test_a_holder_lost_mid_stream_leaves_the_newcomer_a_receiver_and_the_holder_its_step() -> None:
    results = run_workers(_killed_mid_stream, 3, timeout_s=90, may_die=frozenset({1}))
    holder, lost, newcomer = results
    assert lost is None
    assert holder["failed"] == newcomer["failed"] == "RuntimeError"
    # the holder's update waited for the stream: it still holds step 3; the newcomer nothing
    assert holder["after_failure"] == {"step": 3, "dirty": False}
    assert (holder["rebuilt"], newcomer["rebuilt"]) == (0, 1)
    assert newcomer["after_failure"] == {"step": 3, "dirty": True}
    assert holder["again"][0] == "rank 0" and newcomer["again"][0] == "rank 0"
    assert holder["step"] == newcomer["step"] == 4
    for name, tensor in holder["tensors"].items():
        if name not in _BUFFERS:
            assert torch.equal(newcomer["tensors"][name], tensor), name
    assert newcomer["meta"] == holder["meta"]


def _late_bytes(env: WorkerEnv) -> dict[str, Any]:
    """Rank 1 receives a stream from rank 0 that stalls (a holder cut off from the network)
    until a newer round without rank 0 abandons it; rank 1 gives it up and fills its tensor
    as the next round's restore would. Only then do rank 0's sends of the old round go out,
    as a cut-off holder's do when the cut heals: they must not land in rank 1's state.
    Through gloo (``ELASTIC_RT_STREAM_OVER_TCP=0``, the path of device tensors): a stream
    over TCP shuts its sockets when given up (``tests/unit/test_tcp_stream.py``)."""
    os.environ[STREAM_OVER_TCP_ENV] = "0"
    notice = round_notice()
    notice.train_in(loopback_round(0, "a", "b"))
    groups = init_groups(env.store, rank=env.rank, world_size=2, layout=Layout(dp=2),
                         prefix="/late/", timeout=TEN_MINUTES)
    state = torch.full((LATE_CHUNKS * 256,), 1.0 if env.rank == 0 else 0.0)
    agreement = Agreement(step=3, holders=(0,), receivers=(1,))
    if env.rank == 0:
        # the stream's one collective, which the environment above turns from sockets
        assert open_links(host_only=True, is_holder=True, group=groups.world) is None
        env.store.wait(["given-up"])
        pieces = state.view(torch.uint8).split(1024)
        for tag in range(WINDOW + 1):  # what the receiver posted before its first wait
            work = dist.isend(pieces[tag], group_dst=1, group=groups.world, tag=tag)
            assert work is not None
            work.wait()
        destroy_groups(groups)
        return {}
    threading.Timer(NOTICE_AFTER_S, notice.observe, args=(loopback_round(1, "b"),)).start()
    stream = Stream([state], agreement, groups.world, chunk_bytes=1024)
    try:
        stream.finish()
        outcome = "finished"
    except RoundAbandoned:
        outcome = "abandoned"
    stream.give_up()
    state.fill_(7.0)  # the next round's restore, from another holder
    env.store.set("given-up", "1")
    world = groups.world
    assert isinstance(world, NoticedGloo)
    wait_until(world.is_idle, 30, "the old round's receives to complete")
    abandon_groups(groups)
    return {"outcome": outcome, "state": state.clone()}


def test_a_broken_streams_late_bytes_never_land_in_the_receivers_state() -> None:
    _, receiver = run_workers(_late_bytes, 2, timeout_s=60)
    assert receiver["outcome"] == "abandoned"
    assert torch.equal(receiver["state"], torch.full((LATE_CHUNKS * 256,), 7.0))


def _behind_then_holders_lost(env: WorkerEnv) -> dict[str, Any]:
    """Ranks 0 and 1 hold step 3, rank 2 is one step behind (clean at step 2, as a rank
    whose all-reduce had not completed when a peer died): it receives step 3 into fresh
    tensors, which land as the holders' in the streamed step. Then the holders step once
    more alone, and both die as the next stream to rank 2 begins (soak finding 13): rank 2
    must still hold its step 4, clean, and keep it in a round of its own."""
    ctx = _context(env, Layout(dp=env.nprocs), "/behind/")
    trainer = ReplicatedTrainer(_build, _step, StepOptions(), chunk_bytes=CHUNK_BYTES)
    progress, sampler = Progress(), ElasticSampler(64, global_batch_size=4, seed=0)
    _restore(trainer, ctx, progress, sampler)
    assert trainer.state is not None
    _train(trainer.state, sampler, progress, 3 if env.rank < 2 else 2)
    first = _restore(trainer, ctx, progress, sampler)
    _streamed_step(trainer, ctx, progress, sampler, first, step=4)
    landed = _held(trainer, progress, sampler)
    if env.rank < 2:
        _train(trainer.state, sampler, progress, 1)  # step 5, without rank 2
    second = _restore(trainer, ctx, progress, sampler)
    if env.rank < 2:  # both holders die as their step begins, the stream under way
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        _streamed_step(trainer, ctx, progress, sampler, second, step=5)
        raise AssertionError("the step whose stream broke completed")
    except RuntimeError:
        pass
    finally:
        trainer.release()
        abandon_groups(ctx.groups)
    after_failure = {"step": progress.step, "dirty": progress.is_dirty}
    kept = _held(trainer, progress, sampler)
    groups = init_groups(env.store, rank=0, world_size=1, layout=Layout(dp=1),
                         prefix="/behind-alone/", timeout=TIMEOUT)
    ctx = dataclasses.replace(ctx, rank=0, world_size=1, layout=Layout(dp=1), groups=groups)
    try:
        alone = _restore(trainer, ctx, progress, sampler)
        return {"first": _said(first), "sat_out": first.sitting_out, "landed": landed,
                "after_failure": after_failure, "kept": kept, "alone": _said(alone)}
    finally:
        destroy_groups(groups)


def test_a_rank_one_step_behind_keeps_its_state_until_the_newer_one_has_landed() -> None:
    # without the staging copy, rank 2's tensors held half of step 5 after the failure
    # and it restarted dirty: the job's state was lost (docs/soak.md, finding 13)
    results = run_workers(_behind_then_holders_lost, 3, timeout_s=90,
                          may_die=frozenset({0, 1}))
    behind = results[2]
    assert results[:2] == [None, None]
    assert behind["first"][0] == "ranks 0,1" and behind["sat_out"] == (2,)
    assert behind["landed"]["step"] == 4
    assert behind["after_failure"] == {"step": 4, "dirty": False}
    assert behind["alone"][0] == "kept"
    for name, tensor in behind["landed"]["tensors"].items():
        assert torch.equal(behind["kept"]["tensors"][name], tensor), name
    assert behind["kept"]["meta"] == behind["landed"]["meta"]
