"""The runtime-parallel family in real gloo processes: pp, tp and their hybrids with dp train
the same parameters as one process, and a new round re-cuts the state by name.

Each case builds the round's groups from a layout, restores (a fresh start, or the previous
round's state moved by name to the new cut) and trains a few steps of the described model
(``elastic_rt.harness.described_model``, float64); the test compares every parameter with
:func:`reference_params`, the one-process run over the same global batches.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import default_collate

from elastic_rt.harness import described_model as dm
from elastic_rt.sampler import ElasticSampler
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

SAMPLES, GLOBAL_BATCH = 96, 8
TIMEOUT = timedelta(seconds=30)


def _ctx(env: WorkerEnv, layout: Any, number: int, rank: int | None = None) -> Any:
    """Round ``number``'s context; the worker is ``rank`` in it (default: its own number)
    and stays on its own node."""
    from elastic_rt.process_groups import init_groups
    from elastic_rt.worker.context import Context

    rank = env.rank if rank is None else rank
    groups = init_groups(env.store, rank=rank, world_size=layout.world_size, layout=layout,
                         prefix=f"/round-{number}/", timeout=TIMEOUT)
    return Context(rank=rank, world_size=layout.world_size, local_rank=env.rank,
                   node_id=f"n{env.rank}", round=number, token=number, layout=layout, groups=groups)


def _rounds(env: WorkerEnv, rounds: list[tuple[dict[str, int], int]],
            options: dict[str, Any], micro_batch_size: int | None,
            checkpoint_url: str | None = None, copy_every: int = 1,
            clip: float | None = None, autocast_dtype: torch.dtype | None = None,
            from_checkpoint: bool = False, rejoin: bool = False,
            members: list[list[int]] | None = None,
            sequence_parallel: bool = False) -> dict[str, Any]:
    """Train each ``(layout, steps)`` in turn, saving a checkpoint at the end of each when
    ``checkpoint_url`` is given; the parameters at the end, whole, by name. Each rank is a
    node of its own: parts without a replica are copied to the next rank (``copy_every``).

    ``members[i]`` lists round ``i``'s workers (``env.rank``) in rank order (default: the
    first world-size ones), as the rendezvous orders them: survivors keep their order,
    newcomers come last. A worker outside a round leaves for good, unless ``rejoin``: then
    it sits the round out (``"sat out"`` in its sources) and drops its state, as a lost
    node, so that it comes back in a later round holding nothing, like a new node. With
    ``from_checkpoint`` every round after the first starts from nothing too (a new trainer,
    sampler and position: workers started again), so its state can only come from the
    checkpoint the previous round saved. ``sequence_parallel``: the model's plans that cut
    the activations along the sequence between the tensor-parallel ranks."""
    from elastic_rt.checkpoint import Checkpointer
    from elastic_rt.layout import Layout
    from elastic_rt.process_groups import destroy_groups
    from elastic_rt.worker.trainers import Progress, Restoring
    from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel
    from elastic_rt.worker.trainers.runtime_parallel.trainer import RuntimeParallelTrainer

    # autocast leaves float64 alone: a mixed-precision run trains a float32 model
    dtype = torch.float64 if autocast_dtype is None else torch.float32

    def fresh() -> tuple[ElasticSampler, Progress, RuntimeParallelTrainer]:
        sampler = ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0,
                                 micro_batch_size=micro_batch_size)
        trainer = RuntimeParallelTrainer(lambda layout: dm.describe(
                                             dtype=dtype, sequence_parallel=sequence_parallel),
                                         ModelParallel(**options),
                                         copy_every=copy_every, clip_grad_norm=clip,
                                         autocast_dtype=autocast_dtype,
                                         accumulates=micro_batch_size is not None)
        return sampler, Progress(), trainer

    data = dm.Sequences(SAMPLES, dtype=dtype)
    sampler, progress, trainer = fresh()
    checkpoint = Checkpointer(checkpoint_url, async_save=False) if checkpoint_url else None
    sources: list[str] = []
    losses: list[float] = []  # this rank's part of each step's global-batch loss
    outcome: dict[str, Any] = {"left": True}
    for number, (spec, steps) in enumerate(rounds):
        layout = Layout.from_dict(spec)
        ranks = members[number] if members else list(range(layout.world_size))
        assert len(ranks) == layout.world_size, (ranks, layout)
        if env.rank not in ranks:
            if not rejoin:
                return {"left": True}
            sampler, progress, trainer = fresh()
            sources.append("sat out")
            outcome = {"left": True}
            continue
        if from_checkpoint and number > 0:
            sampler, progress, trainer = fresh()
        ctx = _ctx(env, layout, number, ranks.index(env.rank))
        restored = trainer.restore(Restoring(ctx=ctx, checkpoint=checkpoint, sampler=sampler,
                                             progress=progress))
        sources.append(restored.source)
        sampler.set_world(ctx.dp_rank, ctx.dp_size)
        for _ in range(steps):
            micro = [(default_collate([data[i] for i in batch]), len(batch))
                     for batch in sampler.micro_batches()]
            losses.append(trainer.train(micro, global_len=GLOBAL_BATCH, ctx=ctx,
                                        step=progress.step + 1)[1])
            sampler.advance()
            progress.step += 1
        if checkpoint is not None:
            meta = trainer.checkpoint_meta(step=progress.step, sampler=sampler)
            checkpoint.save(progress.step, trainer.checkpoint_state(), layout=layout.to_dict(),
                            extra=meta.encode(), process_group=ctx.groups.world)
            checkpoint.wait()
        model = trainer.result().model
        outcome = {"params": {name: _whole(p) for name, p in model.named_parameters()},
                   "moments": _moments(trainer), "step": progress.step, "losses": losses}
        trainer.release()
        destroy_groups(ctx.groups)
    return outcome if "left" in outcome else {**outcome, "sources": sources}


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()


def _moments(trainer: Any) -> dict[str, torch.Tensor]:
    """The AdamW first moments by parameter name, whole (collective over DTensor meshes)."""
    from elastic_rt.worker.trainers.checkpoint_restore import named_state

    optim = named_state(trainer.result())["optimizer"]
    return {key[len("state."):-len(".exp_avg")]: _whole(value) for key, value in optim.items()
            if key.startswith("state.") and key.endswith(".exp_avg")}


def _check(results: list[dict[str, Any]], steps: int, clip: float | None = None) -> None:
    """Parameters and AdamW moments (the gradients' scale) equal one process's at 1e-5."""
    want, want_moments = dm.reference_state(steps, samples=SAMPLES, global_batch=GLOBAL_BATCH,
                                            clip=clip)
    got: dict[str, torch.Tensor] = {}
    moments: dict[str, torch.Tensor] = {}
    for result in results:
        if "params" in result:
            assert result["step"] == steps
            got.update(result["params"])
            moments.update(result["moments"])
    assert set(got) == set(want) and set(moments) == set(want_moments)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(moments[name], want_moments[name], atol=1e-5, rtol=0,
                                   msg=f"exp_avg of {name}")


@pytest.mark.parametrize("layout, options, micro", [
    ({"dp": 1, "pp": 2}, {"schedule": "GPipe"}, None),
    ({"dp": 1, "tp": 2}, {}, 2),
    ({"dp": 1, "pp": 2, "tp": 2}, {"schedule": "1F1B"}, None),
    ({"dp": 2, "pp": 2}, {"schedule": "1F1B"}, 2),
    ({"dp": 1, "pp": 2}, {"schedule": "Interleaved1F1B", "stages_per_rank": 2}, None),
    ({"dp": 2, "pp": 2}, {"schedule": "LoopedBFS", "stages_per_rank": 2}, 2),
], ids=["pp2-gpipe", "tp2", "pp2xtp2", "pp2xdp2", "pp2-interleaved", "pp2xdp2-loopedbfs"])
def test_a_layout_trains_the_parameters_of_one_process(layout: dict[str, int],
                                                       options: dict[str, Any],
                                                       micro: int | None) -> None:
    world = layout["dp"] * layout.get("pp", 1) * layout.get("tp", 1)
    results = run_workers(_rounds, world, args=([(layout, 3)], options, micro), timeout_s=60)
    _check(results, 3)
    assert {s for r in results for s in r["sources"]} == {"init"}
    if layout["dp"] == 1:  # every rank's part is the whole loss, on every stage
        first = _first_loss()
        for result in results:  # a schedule's first step calls the loss once more
            assert abs(result["losses"][0] - first) < 1e-9, (result["losses"], first)


def _first_loss() -> float:
    """The one-process loss of the first global batch."""
    described = dm.describe()
    sampler = ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0)
    data = dm.Sequences(SAMPLES)
    x, y = default_collate([data[i] for i in sampler.global_batch()])
    return float(described.loss(described.model(x), y))


def test_a_new_cut_takes_the_state_by_name_from_the_survivors() -> None:
    # The last round loses rank 3, a replica of stage 1: every part still has a holder.
    rounds = [({"dp": 2, "pp": 2}, 2), ({"dp": 1, "pp": 2, "tp": 2}, 2), ({"dp": 1, "tp": 4}, 1),
              ({"dp": 2, "pp": 2}, 1), ({"dp": 1, "pp": 3}, 2)]
    results = run_workers(_rounds, 4, args=(rounds, {}, None), timeout_s=60)
    _check(results, 8)
    assert results[0]["sources"] == ["init"] + ["survivors"] * 4
    assert results[3] == {"left": True}


def test_a_lost_part_comes_back_from_the_checkpoint_loaded_by_name_into_the_new_cut(
        tmp_path: Any) -> None:
    # pp2 x tp2 saved at step 3; the next round loses rank 3 (stage 1's second tp shard),
    # and no peer copies are kept, so pp3 loads the checkpoint: tensor shards joined and
    # re-cut by name.
    rounds = [({"dp": 1, "pp": 2, "tp": 2}, 3), ({"dp": 1, "pp": 3}, 2)]
    results = run_workers(_rounds, 4, args=(rounds, {}, None, f"file://{tmp_path}/ckpt", 0),
                          timeout_s=60)
    _check(results, 5)
    assert [r["sources"][1].split()[0] for r in results[:3]] == ["checkpoint"] * 3


def test_a_lost_tensor_parallel_part_comes_back_from_its_peer_copy_into_a_new_cut() -> None:
    # The same loss with copies every step: rank 0 holds rank 3's copy of step 3 (sent as
    # rank 3 finished it), so pp3 takes every part of step 3 by name without storage and
    # nothing is done again.
    rounds = [({"dp": 1, "pp": 2, "tp": 2}, 3), ({"dp": 1, "pp": 3}, 1)]
    results = run_workers(_rounds, 4, args=(rounds, {}, None), timeout_s=60)
    _check(results, 4)
    assert [r["sources"][1] for r in results[:3]] == ["peer copies"] * 3


def _bad_loss_step(env: WorkerEnv) -> str:
    """One pp2 step whose loss raises on the last stage: what each rank's train raises."""
    from elastic_rt.layout import Layout
    from elastic_rt.worker.trainers import Progress, Restoring
    from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel
    from elastic_rt.worker.trainers.runtime_parallel.trainer import RuntimeParallelTrainer

    def build(layout: Layout) -> Any:
        described = dm.describe()

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            raise ValueError("the user's loss is wrong")
        return dataclasses.replace(described, loss=loss)

    ctx = _ctx(env, Layout(dp=1, pp=2), 0)
    sampler = ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0)
    trainer = RuntimeParallelTrainer(build, ModelParallel(schedule="GPipe"))
    trainer.restore(Restoring(ctx=ctx, checkpoint=None, sampler=sampler, progress=Progress()))
    data = dm.Sequences(SAMPLES)
    batch = default_collate([data[i] for i in sampler.local_batch()])
    try:
        trainer.train([(batch, GLOBAL_BATCH)], global_len=GLOBAL_BATCH, ctx=ctx, step=1)
    except Exception as exc:  # noqa: B902 - the test looks at which one
        return type(exc).__name__
    return "nothing"


def test_an_error_in_the_users_loss_is_a_user_code_error_not_a_lost_peer() -> None:
    results = run_workers(_bad_loss_step, 2, timeout_s=60)
    # the last stage's loss raised; the first stage then lost its peer mid-step
    assert results[1] == "UserCodeError", results
