"""Mixed precision of a runtime-parallel round (``run(autocast_dtype=torch.bfloat16)``).

Rule: a sharded round (``shard > 1``) computes in the dtype through FSDP's own
``MixedPrecisionPolicy``, as the sharded family does (torchtitan's choice): every unit's
gathered parameters and inputs are cast to it, and gradients are reduced in float32. An
unsharded round (pp and tp, replicas over dp) runs its forward and loss, and with pp > 1 the
schedule's whole step (it does forward and backward in one call), under ``torch.autocast``;
its gradients are reduced in the parameters' dtype (``grads.py``). Either way the optimizer
steps the parameters in the dtype ``build`` made them, the master copy, and checkpoints and
restores move that dtype. The round's plan decides which applies, so one run may train in
both.

Not guaranteed: the two agree only to bfloat16's precision (FSDP's policy computes every op
in bfloat16, autocast only those on its list), and autocast leaves float64 tensors alone.
float16 is refused (``run_options``): its loss scaler would need one overflow check agreed
over every stage, tensor piece and shard.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from elastic_rt.layout import Layout


def fsdp_policy(dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP's policy for a sharded round: compute in ``dtype``, reduce in float32."""
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def autocast(dtype: torch.dtype | None, layout: Layout,
             device_type: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` in ``dtype`` for an unsharded round; nothing for a sharded one
    (its FSDP policy casts) or without a dtype."""
    if dtype is None or layout.shard > 1:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
