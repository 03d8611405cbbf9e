"""The variables torchrun's agent adds to each worker's environment beyond ranks.

Kept apart from :mod:`agents.worker_env` (ranks and rounds) because these depend on
the worker's output plan, not on the round: ``@record`` (torch.distributed.elastic's
error decorator) writes the exception to ``TORCHELASTIC_ERROR_FILE``, and NCCL
aborts a failed collective instead of hanging when ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
is 1, torchrun's default. ``OMP_NUM_THREADS`` is set by the launcher itself, in
the environment every worker inherits, as torchrun does.
"""

from __future__ import annotations

from typing import Mapping

from elastic_rt import config as cfg

ERROR_FILE_ENV = cfg.ERROR_FILE_ENV
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def with_extras(env: Mapping[str, str], *, error_file: str, role: str) -> dict[str, str]:
    """``env`` plus torchrun's error file, NCCL error handling and role name.

    A user's own ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` wins, as under torchrun.
    """
    return {
        **env,
        ERROR_FILE_ENV: error_file,
        NCCL_ASYNC_ERROR_HANDLING_ENV: env.get(NCCL_ASYNC_ERROR_HANDLING_ENV, "1"),
        cfg.ROLE_NAME_ENV: role,
    }
