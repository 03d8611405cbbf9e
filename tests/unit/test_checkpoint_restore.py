"""The last resort of a restore: a checkpoint, else the initial state, but only on a fresh
start; a job that had trained ends instead of starting over."""

from __future__ import annotations

import pytest

from elastic_rt.errors import StateLostError
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.trainers.checkpoint_restore import from_checkpoint_or_init
from elastic_rt.worker.trainers.protocol import Progress, Restoring


def _restoring(run_reached: int) -> Restoring:
    return Restoring(ctx=None, checkpoint=None,  # type: ignore[arg-type]  # unused here
                     sampler=ElasticSampler(8, global_batch_size=4), progress=Progress(),
                     run_reached=lambda: run_reached)


def _restore(at: Restoring, *, last: int) -> tuple[str, list[str]]:
    calls: list[str] = []

    def init() -> None:
        calls.append("init")

    source = from_checkpoint_or_init(at, lambda: None, state=object(), last=last, init=init)
    return source, calls


@pytest.mark.parametrize("last, run_reached", [(-1, 40), (12, -1), (0, -1), (3, 40)])
def test_state_held_before_and_nothing_committed_ends_the_job(last: int, run_reached: int) -> None:
    at = _restoring(run_reached)
    with pytest.raises(StateLostError, match=f"at step {max(last, run_reached)} was lost"):
        _restore(at, last=last)
    assert at.progress.step == -1  # nothing was started over


@pytest.mark.parametrize("run_reached", [-1, 0])
def test_a_fresh_start_with_nothing_committed_begins_at_step_zero(run_reached: int) -> None:
    at = _restoring(run_reached)
    source, calls = _restore(at, last=-1)
    assert (source, calls, at.progress.step) == ("init", ["init"], 0)
