"""A pipeline stage whose only holder dies comes back from its peer copy, in real gloo
processes: no checkpoint, at most ``peer_copy_every`` steps done again, the same parameters
as one process. (FSDP pieces of pp and tp layouts: test_runtime_parallel_reshard.)

pp2 over two "nodes" (one rank each) trains with copies of each stage on the other rank.
Then rank 1 is lost: SIGKILLed between steps once its newest copy is out (rank 0's next
step raises; with copies every step nothing is done again, every two steps one step), or
in a step after its update and before its copy left (rank 0's step, waiting for that copy,
raises: the step never counted, and nothing that counted is done again), or handing over
at a boundary as a preempted node does. A third process takes its
place as rank 1 of the next pp2 round, holding nothing; stage 1 must come from rank 0's copy
of it, and the run must end where one process ends (``described_model.reference_params``).
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import default_collate

from elastic_rt.harness import described_model as dm
from tests.fixtures.torchdist import WorkerEnv, run_workers

pytestmark = pytest.mark.slow

SAMPLES, GLOBAL_BATCH = 96, 8
TIMEOUT = timedelta(seconds=30)


def _ctx(store: Any, rank: int, layout: Any, number: int) -> Any:
    from elastic_rt.process_groups import init_groups
    from elastic_rt.worker.context import Context

    groups = init_groups(store, rank=rank, world_size=layout.world_size, layout=layout,
                         prefix=f"/round-{number}/", timeout=TIMEOUT)
    return Context(rank=rank, world_size=layout.world_size, local_rank=0, node_id=f"n{rank}",
                   round=number, token=number, layout=layout, groups=groups)


class _Run:
    """One process's trainer, sampler and position, stepping like the loop."""

    def __init__(self, every: int) -> None:
        from elastic_rt.sampler import ElasticSampler
        from elastic_rt.worker.trainers import Progress
        from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel
        from elastic_rt.worker.trainers.runtime_parallel.trainer import RuntimeParallelTrainer

        self.data = dm.Sequences(SAMPLES)
        self.sampler = ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0)
        self.progress = Progress()
        self.trainer = RuntimeParallelTrainer(lambda layout: dm.describe(),
                                              ModelParallel(schedule="GPipe"), copy_every=every)

    def restore(self, ctx: Any) -> tuple[str, int]:
        from elastic_rt.worker.trainers import Restoring

        restored = self.trainer.restore(Restoring(ctx=ctx, checkpoint=None,
                                                  sampler=self.sampler, progress=self.progress))
        self.sampler.set_world(ctx.dp_rank, ctx.dp_size)
        return restored.source, self.progress.step

    def step(self, ctx: Any) -> None:
        micro = [(default_collate([self.data[i] for i in batch]), len(batch))
                 for batch in self.sampler.micro_batches()]
        self.trainer.train(micro, global_len=GLOBAL_BATCH, ctx=ctx, step=self.progress.step + 1)
        self.sampler.advance()
        self.progress.step += 1

    def params(self) -> dict[str, Any]:
        model = self.trainer.result().model
        return {name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                for name, p in model.named_parameters()}


def _lose_stage_1(env: WorkerEnv, every: int, before: int, total: int,
                  how: str) -> dict[str, Any]:
    from elastic_rt.layout import Layout
    from elastic_rt.process_groups import destroy_groups

    pp2 = Layout(dp=1, pp=2)
    run = _Run(every)
    failed = "no step failed"
    if env.rank < 2:
        ctx = _ctx(env.store, env.rank, pp2, 0)
        run.restore(ctx)
        for _ in range(before):
            run.step(ctx)
        if how == "hand_over":
            run.trainer.hand_over(ctx, run.progress.step)
        elif env.rank == 1 and how == "kill-before-copy":  # its update applied, no copy sent

            def die(*_: Any, **__: Any) -> None:
                os.kill(os.getpid(), signal.SIGKILL)
            setattr(run.trainer.copies, "refresh", die)
            run.step(ctx)
        elif env.rank == 1:  # killed once its newest copy is out
            copies = run.trainer.copies.round
            assert copies is not None
            copies.settle()  # its last send has landed on rank 0
            env.store.set("rank1-killed", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            if how == "kill":
                env.store.wait(["rank1-killed"])
            try:
                run.step(ctx)  # its peer is gone: the step raises and changes nothing
            except Exception as exc:  # noqa: B902 - what the loop catches
                failed = type(exc).__name__
        run.trainer.release()
        destroy_groups(ctx.groups)
        if env.rank == 1:
            return {"left": True}
    # round 1: rank 0 and a newcomer in rank 1's place
    ctx = _ctx(env.store, min(env.rank, 1), pp2, 1)
    source, restored = run.restore(ctx)
    while run.progress.step < total:
        run.step(ctx)
    params = run.params()
    run.trainer.release()
    destroy_groups(ctx.groups)
    return {"params": params, "source": source, "restored": restored, "failed": failed,
            "step": run.progress.step}


@pytest.mark.parametrize("every, before, how, restored", [
    (1, 3, "kill", 3),       # the copy of step 3 went out as rank 1 finished it
    (2, 3, "kill", 2),       # copies of steps 0 and 2: step 3 done again
    (2, 3, "hand_over", 3),  # copies refreshed at the boundary: nothing done again
    # killed in step 4 after its update, before its copy left: step 4 never counted on
    # rank 0 either (it waits for the copies), so the round resumes after step 3
    (1, 3, "kill-before-copy", 3),
], ids=["kill-every-1", "kill-every-2", "hand-over", "kill-before-copy"])
def test_a_lost_stage_comes_back_from_its_peer_copy_with_no_checkpoint(
        every: int, before: int, how: str, restored: int) -> None:
    total = 6
    results = run_workers(_lose_stage_1, 3, args=(every, before, total, how), timeout_s=90,
                          may_die=frozenset({1}))
    survivor, newcomer = results[0], results[2]
    if how.startswith("kill"):  # its next step raised, and the loop would have retried it
        assert results[1] is None and survivor["failed"] != "no step failed"
    else:
        assert results[1] == {"left": True} and survivor["failed"] == "no step failed"
    assert survivor["source"] == newcomer["source"] == "peer copies"
    assert survivor["restored"] == newcomer["restored"] == restored
    assert before - restored <= every
    want = dm.reference_params(total, samples=SAMPLES, global_batch=GLOBAL_BATCH)
    got = {**survivor["params"], **newcomer["params"]}
    assert set(got) == set(want) and survivor["step"] == newcomer["step"] == total
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)
