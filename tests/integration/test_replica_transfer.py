"""A replicated restore over real gloo processes: nothing moves where nothing must.

Three ranks train the same AdamW model (a scheduler, extras, one transposed and so
non-contiguous parameter) for three steps from a fresh start. Restored again, all three
hold the same state: nothing moves and nothing is touched. Then rank 2 is replaced by a
newcomer (built, never stepped, empty AdamW state) while ranks 0 and 1 train two steps
more: the newcomer ends bitwise equal to them, model, optimizer (step counts, the
scheduler's learning rate) and TrainMeta, and the holders share the sending, in chunks
small enough that many go each way.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from elastic_rt.layout import Layout
from elastic_rt.process_groups import destroy_groups
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers import Progress, Restoring, StepOptions
from elastic_rt.worker.trainers.replica_state import named_tensors
from elastic_rt.worker.trainers.replicated import ReplicatedTrainer
from tests.fixtures.meta_paths import _context
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

CHUNK_BYTES = 96
"""So that each tensor of the model goes in several chunks."""


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 16)
        self.second = torch.nn.Linear(16, 3)
        self.mix = torch.nn.Parameter(torch.randn(3, 6).t())  # non-contiguous, so is exp_avg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))) + (x @ self.mix)


def _build(layout: Layout) -> TrainState:
    torch.manual_seed(0)  # every rank builds the same model
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, extras={"n": 0})


def _no_step(state: TrainState, batch: Any) -> torch.Tensor:
    raise AssertionError("the runtime's step is not used here")


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
    return {"tensors": {name: t.clone() for name, t in named_tensors(trainer.state)},
            "strided": [name for name, t in named_tensors(trainer.state)
                        if not t.is_contiguous()],
            "groups": json.dumps(trainer.state.optimizer.state_dict()["param_groups"]),
            "meta": json.dumps(meta, sort_keys=True), "step": progress.step}


def _restore(trainer: ReplicatedTrainer, ctx: Any, progress: Progress,
             sampler: ElasticSampler) -> tuple[str, int | None]:
    trainer.release()
    done = trainer.restore(Restoring(ctx=ctx, checkpoint=None, sampler=sampler,
                                     progress=progress))
    return done.source, done.bytes_moved


def _kill_then_join(env: WorkerEnv) -> dict[str, Any]:
    ctx = _context(env, Layout(dp=env.nprocs), "/replica/")
    try:
        def fresh() -> tuple[ReplicatedTrainer, Progress, ElasticSampler]:
            trainer = ReplicatedTrainer(_build, _no_step, StepOptions(), chunk_bytes=CHUNK_BYTES)
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
            trainer, progress, sampler = fresh()  # a newcomer in its place
        else:
            _train(trainer.state, sampler, progress, 2)  # type: ignore[arg-type]
        joined = _restore(trainer, ctx, progress, sampler)
        return {"kept": list(kept), "untouched": untouched, "joined": list(joined),
                **_held(trainer, progress, sampler)}
    finally:
        destroy_groups(ctx.groups)


def test_survivors_move_nothing_and_a_newcomer_gets_the_holders_state_bitwise() -> None:
    results = run_workers(_kill_then_join, 3, timeout_s=90)
    for got in results:
        assert got["kept"] == ["kept", 0] and got["untouched"]
    holder, newcomer = results[0], results[2]
    assert newcomer["step"] == holder["step"] == 5
    assert newcomer["tensors"].keys() == holder["tensors"].keys()
    for name, tensor in holder["tensors"].items():
        assert torch.equal(newcomer["tensors"][name], tensor), name
        assert torch.equal(results[1]["tensors"][name], tensor), name
    assert any(name.endswith(".step") for name in holder["tensors"])
    assert {"model.mix", "optimizer.0.exp_avg"} <= set(newcomer["strided"])  # staged
    assert newcomer["groups"] == holder["groups"] and newcomer["meta"] == holder["meta"]
    total = sum(t.numel() * t.element_size() for t in holder["tensors"].values())
    sent = [results[0]["joined"][1], results[1]["joined"][1]]
    assert newcomer["joined"] == ["ranks 0,1", total]
    assert sum(sent) == total and all(abs(s - total / 2) <= 2 * CHUNK_BYTES for s in sent)
    assert total > 20 * CHUNK_BYTES  # many chunks each way
