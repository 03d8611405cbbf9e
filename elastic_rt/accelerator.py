"""Which device a worker trains on and which backend its process groups use.

With CUDA present, a worker uses ``cuda:LOCAL_RANK`` (it calls ``torch.cuda.set_device``
first, as a torchrun script does, so NCCL and ``torch.cuda.current_device()`` agree), and
its groups are mixed: NCCL for CUDA tensors, gloo for CPU tensors. Without CUDA, the CPU
and gloo. ``ELASTIC_RT_BACKEND=gloo`` keeps gloo with CUDA models, e.g. for several
workers sharing one GPU, which NCCL refuses ("Duplicate GPU detected").

Why mixed groups and not plain NCCL: the runtime's own collectives beside training are
CPU tensors and objects (each rank's step when a round re-forms, the state broadcast from
a survivor, the global-loss sum, shard holders), and so may be a user's; on a plain NCCL
group each of those would fail. Gradients are CUDA tensors, so they travel over NCCL.
NCCL communicators are made lazily, at a group's first CUDA collective, so a CPU model on
a GPU machine never opens one.

The choices are pure functions of what they are given (:func:`choose_device`,
:func:`choose_backend`), so they are tested without a GPU; :func:`use_worker_device`
applies them to this process.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import torch

from elastic_rt.config import BACKEND_ENV, WorkerEnv
from elastic_rt.errors import ConfigError

logger = logging.getLogger(__name__)

GLOO = "gloo"
MIXED = "cpu:gloo,cuda:nccl"
"""torch's name for a group with a backend per device type."""
_REQUESTS = {"gloo": GLOO, "nccl": MIXED}


def choose_device(*, local_rank: int, cuda_available: bool, device_count: int) -> torch.device:
    """``cuda:local_rank`` when CUDA is available, else the CPU.

    Raises:
        ConfigError: there are fewer visible GPUs than workers on this node.
    """
    if not cuda_available:
        return torch.device("cpu")
    if not 0 <= local_rank < device_count:
        raise ConfigError(
            f"worker with LOCAL_RANK={local_rank} has no GPU of its own: {device_count} visible",
            f"Run at most {device_count} workers per node (--nproc-per-node), or set "
            "CUDA_VISIBLE_DEVICES to list more GPUs.",
        )
    return torch.device("cuda", local_rank)


def choose_backend(*, cuda_available: bool, requested: str | None) -> str:
    """The process-group backend: ``requested`` if set, else mixed with CUDA, else gloo.

    ``requested`` is ``ELASTIC_RT_BACKEND``: ``gloo``, or ``nccl`` (mixed groups:
    NCCL for CUDA tensors, gloo for the CPU ones).

    Raises:
        ConfigError: an unknown name, or ``nccl`` without CUDA.
    """
    if not requested:
        return MIXED if cuda_available else GLOO
    backend = _REQUESTS.get(requested.strip().lower())
    if backend is None:
        raise ConfigError(f"{BACKEND_ENV}={requested!r} is not a backend we support",
                          f"Set {BACKEND_ENV} to gloo or nccl, or unset it.")
    if backend == MIXED and not cuda_available:
        raise ConfigError(f"{BACKEND_ENV}=nccl but CUDA is not available to this worker",
                          f"Unset {BACKEND_ENV} (gloo is used without CUDA), or run on a GPU.")
    return backend


def backend_from_env(env: Mapping[str, str] = os.environ) -> str:
    """:func:`choose_backend` for this process (its CUDA, its ``ELASTIC_RT_BACKEND``)."""
    return choose_backend(cuda_available=torch.cuda.is_available(),
                          requested=env.get(BACKEND_ENV))


def uses_nccl(backend: str) -> bool:
    """Whether groups of ``backend`` (as torch names it) have NCCL communicators."""
    return "nccl" in str(backend)


def use_worker_device(local_rank: int) -> torch.device:
    """Make ``cuda:LOCAL_RANK`` this worker's current device, when it has one.

    Called before the user's ``build``, so a model built on :func:`worker_device` (or
    ``"cuda"``) lands on this worker's own GPU. A worker without a GPU of its own (more
    workers on the node than visible GPUs) stays on the CPU with a warning rather than
    failing: its model may well be a CPU one; :func:`worker_device` is what refuses.
    """
    available = torch.cuda.is_available()
    try:
        device = choose_device(local_rank=local_rank, cuda_available=available,
                               device_count=torch.cuda.device_count() if available else 0)
    except ConfigError as exc:
        logger.warning("%s; this worker's current device stays the CPU", exc.problem)
        return torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        logger.info("worker uses %s (%s)", device, torch.cuda.get_device_name(device))
    return device


def worker_device() -> torch.device:
    """The device this worker should put its model on: ``cuda:LOCAL_RANK``, or the CPU.

    For the user's ``build``: ``model.to(elastic_rt.worker_device())``.

    Raises:
        ConfigError: see :func:`choose_device`; or ``LOCAL_RANK`` is not a number.
    """
    local_rank = WorkerEnv.from_env().local_rank
    available = torch.cuda.is_available()
    return choose_device(local_rank=local_rank, cuda_available=available,
                         device_count=torch.cuda.device_count() if available else 0)
