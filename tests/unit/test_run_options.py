"""run()'s arguments are checked once, each refusal one line naming the field and the fix."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import pytest
import torch

from elastic_rt.errors import ConfigError
from elastic_rt.layout import ModelLimits
from elastic_rt.worker.run_options import RunOptions

FSDP = ModelLimits(max_shard=2)
OWNED_AMP = ("autocast_dtype or clip_grad_norm is set but build() owns its step (step=None)",
             "Apply autocast and clipping inside the object's step(), or pass a step function.")
SHARDED_FP16 = ("autocast_dtype=torch.float16 with a sharded layout (max_shard > 1)",
                "Pass autocast_dtype=torch.bfloat16 (FSDP's mixed precision, no scaler), "
                "or train replicated (max_shard=1).")


@pytest.mark.parametrize(("fields", "problem", "fix"), [
    ({"max_steps": -1}, "max_steps=-1, global_batch_size=8",
     "Pass max_steps >= 0 and global_batch_size >= 1."),
    ({"global_batch_size": 0}, "max_steps=10, global_batch_size=0",
     "Pass max_steps >= 0 and global_batch_size >= 1."),
    ({"is_step_owned": True, "micro_batch_size": 2},
     "micro_batch_size is set but build() owns its step (step=None)",
     "Split micro-batches inside the object's step(), or pass a step function."),
    ({"is_step_owned": True, "autocast_dtype": torch.bfloat16}, *OWNED_AMP),
    ({"is_step_owned": True, "clip_grad_norm": 1.0}, *OWNED_AMP),
    ({"limits": FSDP, "autocast_dtype": torch.float16}, *SHARDED_FP16),
    ({"is_step_owned": True, "is_runtime_parallel": True, "autocast_dtype": torch.float16},
     "autocast_dtype=torch.float16 with model_parallel",
     "Pass autocast_dtype=torch.bfloat16 (it needs no loss scaler)."),
])
def test_a_combination_that_cannot_train_is_refused_in_one_line(
        fields: dict[str, Any], problem: str, fix: str) -> None:
    with pytest.raises(ConfigError) as raised:
        RunOptions(**{"global_batch_size": 8, "max_steps": 10, **fields})
    assert (raised.value.problem, raised.value.fix) == (problem, fix)
    assert str(raised.value) == f"{problem}. {fix}"


def test_what_can_train_is_accepted_and_frozen() -> None:
    sharded = RunOptions(global_batch_size=8, max_steps=0, limits=FSDP, clip_grad_norm=1.0,
                         micro_batch_size=2, autocast_dtype=torch.bfloat16)
    owned = RunOptions(global_batch_size=8, max_steps=10, is_step_owned=True, limits=FSDP)
    plain = RunOptions(global_batch_size=1, max_steps=10, micro_batch_size=1,
                       autocast_dtype=torch.bfloat16)
    RunOptions(global_batch_size=8, max_steps=10, is_step_owned=True, is_runtime_parallel=True,
               limits=FSDP, micro_batch_size=2, autocast_dtype=torch.bfloat16)
    assert (sharded.is_sharded, owned.is_sharded, plain.is_sharded) == (True, False, False)
    with pytest.raises(FrozenInstanceError):
        plain.max_steps = 11  # type: ignore[misc]
