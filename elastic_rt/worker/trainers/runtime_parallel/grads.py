"""Sum a rank's gradients over its data-parallel group: one flat all-reduce per dtype.

First, a gradient that backward left ``Partial`` on the tensor-parallel mesh (a
``SequenceParallel`` norm's weight: each rank saw its slice of the sequence) is summed over
tp into its parameter's placement (:func:`settle_partial`), as FSDP2 does for its own
parameters before its reduce-scatter; after that a DTensor gradient holds what its
parameter's placement says, which is what the dp sum and the clipping norm count.

Rule: the replicas of one ``(pp, tp)`` part hold the same parameters (tensor-parallel ones
as the same DTensor shards), so their local gradients add up position by position. A
parameter without a gradient (no sample reached it on this rank) counts as zeros, so every
replica sends the same layout of bytes. Runs after the pipeline's backward and before the
optimizer: a failed all-reduce leaves every parameter as it was.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from elastic_rt.worker import abort


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def settle_partial(params: list[nn.Parameter]) -> None:
    """Redistribute each DTensor gradient whose placements differ from its parameter's to
    the parameter's (``Partial`` -> ``Replicate``: an all-reduce over tp). Collective over
    the tp group, on the groups whose waits ask the round notice (``abort``)."""
    for param in params:
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) \
                and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def sum_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Every parameter's ``.grad`` summed over ``group`` in place. Collective."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        grad = _local(param.grad)  # type: ignore[arg-type]
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None  # async_op=True always returns a Work
        abort.wait(work.get_future())
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
