"""Clip a runtime-parallel rank's gradients to one global L2 norm, as one process would.

Rule: the norm is that of the whole model's gradient, whatever the layout. Each rank adds the
squares of its own gradient's local values, each tensor divided by how many ranks of the
world hold those same values: a parameter lives on the ``dp * tp`` ranks of its stage, and
its gradient is cut into as many distinct pieces as its DTensor's ``Shard`` and
``_StridedShard`` placements make (tensor-parallel and FSDP cuts; ``Replicate`` ones, the
HSDP replicas, and plain tensors make none). One all-reduce of the world then gives the
square of the global norm on every rank, and every rank scales its local gradients by
torch's ``clip_grad_norm_`` factor ``min(1, max_norm / (norm + 1e-6))``.

Runs after the gradients are summed over dp (by FSDP or ``grads.py``) and before the
optimizer step, so the step stays atomic: a failed all-reduce changed no parameter.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from elastic_rt.layout import Layout
from elastic_rt.worker import abort


def holders(tensor: torch.Tensor, layout: Layout) -> int:
    """How many ranks of the world hold the same local values as this rank's ``tensor``."""
    pieces = 1
    if isinstance(tensor, DTensor):
        pieces = math.prod(tensor.device_mesh.size(axis)
                           for axis, p in enumerate(tensor.placements)
                           if isinstance(p, (Shard, _StridedShard)))
    return layout.dp * layout.tp // pieces


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, layout: Layout,
                   world: dist.ProcessGroup) -> float:
    """Scale ``params``' gradients in place so that the whole model's norm is at most
    ``max_norm``; the norm before clipping. Collective over ``world``."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros(1, dtype=torch.float64)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        total += local.detach().double().pow(2).sum() / holders(grad, layout)
    work = dist.all_reduce(total, group=world, async_op=True)
    assert work is not None  # async_op=True always returns a Work
    abort.wait(work.get_future())
    norm = float(total.sqrt())
    scale = min(1.0, max_norm / (norm + 1e-6))
    if scale < 1.0:
        with torch.no_grad():
            for grad in grads:
                (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    return norm
