"""bfloat16 under model_parallel: FSDP's policy in a sharded round, autocast in the others."""

from __future__ import annotations

import torch

from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.runtime_parallel.precision import autocast, fsdp_policy


def test_an_unsharded_round_computes_under_autocast_and_a_sharded_one_does_not() -> None:
    for layout in (Layout(dp=1, pp=2), Layout(dp=2, tp=2)):
        with autocast(torch.bfloat16, layout, "cpu"):
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    for dtype, layout in ((torch.bfloat16, Layout(dp=2, tp=2, shard=2)), (None, Layout(dp=1))):
        with autocast(dtype, layout, "cpu"):
            assert not torch.is_autocast_enabled("cpu")


def test_a_sharded_round_computes_in_the_dtype_and_reduces_in_float32() -> None:
    policy = fsdp_policy(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy(None) == type(policy)()  # FSDP's default: the parameters' dtype
