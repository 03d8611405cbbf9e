"""The runtime-parallel family across layouts, in real gloo processes: a checkpoint saved
from any cut loads into any other, and a lost rank's layout is re-planned from the
survivors and grows back when a new node comes.

Both compare with one float64 process at 1e-5: the matrix, as soon as a rank has loaded,
its pieces of every parameter and of every entry of AdamW's state (``_matches``); the kill
and growth, at the end, the whole parameters and first moments through the harness of
``test_runtime_parallel`` (``_rounds``, ``_check``).
"""

from __future__ import annotations

import gc
from functools import partial
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import default_collate

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.harness import described_model as dm
from elastic_rt.layout import Layout, ModelLimits, plan_layout
from elastic_rt.process_groups import destroy_groups
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.context import Context
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers import Progress, Restoring
from elastic_rt.worker.trainers.checkpoint_restore import named_state
from elastic_rt.worker.trainers.runtime_parallel.by_name import flatten
from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel
from elastic_rt.worker.trainers.runtime_parallel.trainer import RuntimeParallelTrainer
from tests.fixtures.torchdist import WorkerEnv, run_workers
from tests.integration.test_runtime_parallel import (
    GLOBAL_BATCH,
    SAMPLES,
    _check,
    _ctx,
    _rounds,
)

pytestmark = pytest.mark.slow

_LAYOUTS = {
    "pp2xtp2": {"dp": 1, "pp": 2, "tp": 2},
    "fsdp4": {"dp": 4, "shard": 4},
    "fsdp2xtp2": {"dp": 2, "tp": 2, "shard": 2},
    "pp2xdp2": {"dp": 2, "pp": 2},
    "pp4": {"dp": 1, "pp": 4},
    "pp2xfsdp2": {"dp": 2, "pp": 2, "shard": 2},
    "tp4": {"dp": 1, "tp": 4},
    "hsdp2x2": {"dp": 4, "shard": 2},
    "tp2xdp2": {"dp": 2, "tp": 2},
    "dp4": {"dp": 4},
    # 3 and 2 ranks: the others sit the round out
    "fsdp3": {"dp": 3, "shard": 3},
    "pp3": {"dp": 1, "pp": 3},
    "pp2": {"dp": 1, "pp": 2},
    "tp2": {"dp": 1, "tp": 2},
}
_NAMES = list(_LAYOUTS)
_PAIRS = [(_NAMES[(i - k) % len(_NAMES)], target) for i, target in enumerate(_NAMES)
          for k in range(1, len(_NAMES) // 2 + 1)]
"""Each cut loads the checkpoints of the seven before it in the (cyclic) order above: every
two cuts meet, one way or the other (both ways at a distance of seven), in 98 loads; all
182 took 52 s of a 20-minute suite."""
# Two steps: Adam's moments then mix two gradients, and its step count is not the first
# step's.
STEPS = 2
ATOL = 1e-5


def test_a_checkpoint_of_any_cut_loads_into_any_other(tmp_path: Any) -> None:
    """The reshard matrix: each layout trains 2 steps from the start and saves a checkpoint,
    which seven other layouts load into a trainer holding nothing (a worker started again):
    every two layouts, one into the other (``_PAIRS``).

    Tensor-parallel DTensors, pipeline stages and FSDP / HSDP pieces (``_StridedShard``
    included) are joined and re-cut by name into every other cut, 4 ranks into 3 and 2 and
    back. Every load must restore the one process's step 2: every parameter and every
    entry of AdamW's state (tensors at 1e-5), the step and the sampler's position. Nothing
    trains between loads: what a load restores depends on its checkpoint alone, and a step
    after each of the 98 would add half again to the run (training on from a checkpoint:
    ``test_runtime_parallel``)."""
    results = run_workers(_matrix, 4, args=(f"file://{tmp_path}/ckpt",), timeout_s=240)
    names = {_parameter_of(key) for key in _expected()["state"]}
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], rank
        loaded = [pair for pair in _PAIRS
                  if rank < Layout.from_dict(_LAYOUTS[pair[1]]).world_size]
        assert list(result["sources"]) == loaded, rank
        assert set(result["sources"].values()) == {"checkpoint"}, rank
    for pair in _PAIRS:  # each parameter was held, whole or in pieces, and compared
        assert {name for result in results
                for name in result["checked"].get(pair, [])} == names, pair
    assert len(results[0]["sources"]) == 98  # rank 0 is in every layout


def _matrix(env: WorkerEnv, root: str) -> dict[str, Any]:
    """Save each layout's checkpoint, then load them as ``_PAIRS`` says, a round per
    layout loaded into (its groups formed once); what differed from the one process,
    where each load's state came from, and which parameters this rank compared."""
    # A load leaves cycles (modules, meshes, groups) for the collector, whose full
    # collections would otherwise walk the whole imported heap (torch) each time
    gc.freeze()
    names = _NAMES
    # One checkpointer per checkpoint, never closed: closing drops its side group, and the
    # next one over the same ranks in the same round (torch names it by its ranks) would
    # find the closed group's addresses in the store
    checkpoints = {name: Checkpointer(f"{root}/{name}", async_save=False) for name in names}
    for number, name in enumerate(names):
        layout = Layout.from_dict(_LAYOUTS[name])
        if env.rank < layout.world_size:
            _save(env, layout, number, checkpoints[name])
    want = _expected()
    mismatches: list[tuple[str, str, str]] = []
    sources: dict[tuple[str, str], str] = {}
    checked: dict[tuple[str, str], list[str]] = {}
    for number, target in enumerate(names, start=len(names)):
        layout = Layout.from_dict(_LAYOUTS[target])
        if env.rank >= layout.world_size:
            continue
        ctx = _ctx(env, layout, number)
        for source in [s for s, t in _PAIRS if t == target]:
            pair = (source, target)
            sources[pair], checked[pair], far = _load(ctx, checkpoints[source], want)
            mismatches += [(source, target, what) for what in far]
        destroy_groups(ctx.groups)
    return {"mismatches": mismatches, "sources": sources, "checked": checked}


def _fresh() -> tuple[ElasticSampler, Progress, RuntimeParallelTrainer]:
    """What a worker started again holds: no state, no position; no peer copies either, so
    that a load is the checkpoint's alone."""
    sampler = ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0)
    trainer = RuntimeParallelTrainer(lambda layout: dm.describe(), ModelParallel(),
                                     copy_every=0)
    return sampler, Progress(), trainer


def _save(env: WorkerEnv, layout: Layout, number: int, checkpoint: Checkpointer) -> None:
    """Train ``STEPS`` from the start in ``layout`` (round ``number``), then save."""
    ctx = _ctx(env, layout, number)
    sampler, progress, trainer = _fresh()
    trainer.restore(Restoring(ctx=ctx, checkpoint=None, sampler=sampler, progress=progress))
    sampler.set_world(ctx.dp_rank, ctx.dp_size)
    data = dm.Sequences(SAMPLES)
    for _ in range(STEPS):
        micro = [(default_collate([data[i] for i in batch]), len(batch))
                 for batch in sampler.micro_batches()]
        trainer.train(micro, global_len=GLOBAL_BATCH, ctx=ctx, step=progress.step + 1)
        sampler.advance()
        progress.step += 1
    meta = trainer.checkpoint_meta(step=progress.step, sampler=sampler)
    checkpoint.save(progress.step, trainer.checkpoint_state(), layout=layout.to_dict(),
                    extra=meta.encode(), process_group=ctx.groups.world)
    trainer.release()
    destroy_groups(ctx.groups)


def _load(ctx: Context, checkpoint: Checkpointer,
          want: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    """A fresh trainer restored from ``checkpoint`` into ``ctx``'s cut: where its state came
    from, the parameters this rank holds (or pieces of), and the entries of theirs that
    differ from ``want`` (:func:`_expected`), missing and extra ones included."""
    sampler, progress, trainer = _fresh()
    restored = trainer.restore(Restoring(ctx=ctx, checkpoint=checkpoint, sampler=sampler,
                                         progress=progress))
    got = flatten(named_state(trainer.result()))
    held = {_parameter_of(key) for key in got}
    far = [key for key in sorted(set(got) | set(want["state"]))
           if _parameter_of(key) in held and not _matches(got.get(key), want["state"].get(key))]
    if progress.step != STEPS or sampler.state_dict() != want["sampler"]:
        far.append(f"position: step {progress.step}, sampler {sampler.state_dict()}")
    trainer.release()
    return restored.source.split()[0], sorted(held), far


def _parameter_of(key: str) -> str:
    """The parameter an entry of the flat by-name state belongs to: ``model/<name>``,
    ``optimizer/state.<name>.exp_avg``, ``optimizer/param_groups.<name>.lr``..."""
    side, entry = key.split("/", 1)
    return entry if side == "model" else entry.split(".", 1)[1].rsplit(".", 1)[0]


def _matches(got: Any, want: Any) -> bool:
    """Whether ``got`` is ``want``, tensors at 1e-5; of a DTensor, this rank's piece: its
    local tensor against ``want`` cut by the same placements. That takes no collective,
    where gathering every tensor whole after each of the 182 loads took seconds."""
    if not isinstance(want, torch.Tensor):
        return got == want
    if isinstance(got, DTensor):
        want = distribute_tensor(want, got.device_mesh, got.placements,
                                 src_data_rank=None).to_local()
        got = got.to_local()
    return (isinstance(got, torch.Tensor) and (got.shape, got.dtype) == (want.shape, want.dtype)
            and torch.allclose(got.detach(), want, rtol=0, atol=ATOL))


def _expected() -> dict[str, Any]:
    """The one process's run of ``dm.reference_state`` to step ``STEPS``: its whole state
    by the names a checkpoint has (``reference_state`` leaves out Adam's second moments and
    settings), and its sampler's position."""
    described = dm.describe()
    state = TrainState(model=described.model,
                       optimizer=described.optimizer(list(described.model.parameters())))
    data = dm.Sequences(SAMPLES)
    sampler = ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0)
    for _ in range(STEPS):
        x, y = default_collate([data[i] for i in sampler.global_batch()])
        state.optimizer.zero_grad()
        described.loss(described.model(x), y).backward()
        state.optimizer.step()
        sampler.advance()
    return {"state": flatten(named_state(state)), "sampler": sampler.state_dict()}


# The 4-rank layouts, the limits that allow them (the planner's 3-rank layout then), and the
# worker lost: the last, or one in the middle, which renumbers the survivors after it
# (the rendezvous keeps their order) while the newcomer comes back last.
_KILLED = {
    "pp2xdp2": ({"dp": 2, "pp": 2}, ModelLimits(max_pp=2), 1),
    "tp2xdp2": ({"dp": 2, "tp": 2}, ModelLimits(tp_options=(1, 2)), 3),
    "fsdp2xtp2": ({"dp": 2, "tp": 2, "shard": 2},
                  ModelLimits(tp_options=(1, 2), max_shard=4), 1),
    "pp2xfsdp2": ({"dp": 2, "pp": 2, "shard": 2}, ModelLimits(max_pp=2, max_shard=4), 3),
}


@pytest.mark.parametrize("name", list(_KILLED))
def test_a_lost_rank_is_replanned_from_the_survivors_and_a_newcomer_grows_it_back(
        name: str) -> None:
    # A worker is lost after step 2 (between rounds: what the runtime sees after a
    # SIGKILL), the 3 survivors train 2 steps in the planner's 3-rank layout (dp3, or
    # fsdp3 where sharding is allowed), and the worker comes back holding nothing, as rank
    # 3 of the 4-rank layout. No checkpoint. An FSDP piece has one holder, so the sharded
    # layouts take the lost worker's piece from the copy its holder keeps (of step 2, sent
    # as the worker finished it: nothing is done again); the others keep no copies: what
    # the survivors hold is all there is.
    layout, limits, lost = _KILLED[name]
    is_sharded = layout.get("shard", 1) > 1
    three = plan_layout(3, limits)
    assert three == (Layout(dp=3, shard=3) if is_sharded else Layout(dp=3))
    rounds = [(layout, 2), (three.to_dict(), 2), (layout, 2)]
    stayed = [w for w in range(4) if w != lost]
    members = [[0, 1, 2, 3], stayed, stayed + [lost]]
    results = run_workers(partial(_rounds, rejoin=True, members=members), 4,
                          args=(rounds, {}, None, None, 1 if is_sharded else 0),
                          timeout_s=120)
    _check(results, 6)
    again = "peer copies" if is_sharded else "survivors"
    for worker in stayed:
        assert results[worker]["sources"] == ["init", again, "survivors"]
    assert results[lost]["sources"] == ["init", "sat out", "survivors"]
