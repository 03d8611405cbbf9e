"""The environment of each local worker: its place in a round, plus torchrun's extras.

The round part is a :class:`~elastic_rt.config.WorkerEnv`, written with its ``to_env``
(the one path: the library reads the same class back with ``from_env``). Workers in
a round get torchrun's variables, so an unmodified torchrun script runs; workers
started in standby (outside any round) get no rank until a round admits them.

The extras (:func:`with_extras`) depend on the worker's output plan, not on the
round, so the process layer adds them when it spawns: ``@record``
(torch.distributed.elastic's error decorator) writes the exception to
``TORCHELASTIC_ERROR_FILE``, and NCCL aborts a failed collective instead of hanging
when ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 1, torchrun's default.
``OMP_NUM_THREADS`` is set by the launcher itself, in the environment every worker
inherits, as torchrun does.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from elastic_rt import config as cfg
from elastic_rt.config import WorkerEnv
from elastic_rt.rendezvous.rounds import Round

ERROR_FILE_ENV = cfg.ERROR_FILE_ENV
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun's ``--signals-to-handle`` default, which its workers inherit."""


def round_envs(node: WorkerEnv, round_: Round, *, master: tuple[str, int],
               restart_count: int) -> list[WorkerEnv]:
    """One environment per local worker of ``node`` (its shared fields) in ``round_``."""
    nproc = round_.nprocs[round_.group_rank(node.node_id)]
    offset = round_.rank_offset(node.node_id)
    shared = dataclasses.replace(
        node,
        world_size=round_.world_size,
        local_world_size=nproc,
        group_rank=round_.group_rank(node.node_id),
        group_world_size=len(round_.members),
        master_addr=master[0],
        master_port=master[1],
        restart_count=restart_count,
        round=round_.number,
        token=round_.token,
    )
    return [dataclasses.replace(shared, rank=offset + i, local_rank=i) for i in range(nproc)]


def standby_envs(node: WorkerEnv, nproc: int, *, restart_count: int) -> list[WorkerEnv]:
    """Workers started before their node is admitted: round -1, no rank yet."""
    shared = dataclasses.replace(
        node, local_world_size=nproc, restart_count=restart_count, round=-1
    )
    return [dataclasses.replace(shared, local_rank=i) for i in range(nproc)]


def process_env(base: Mapping[str, str], env: WorkerEnv) -> dict[str, str]:
    """The full environment of a worker process: the agent's own plus ``env``."""
    return {**base, **env.to_env(), "PYTHONUNBUFFERED": "1"}


def with_extras(env: Mapping[str, str], *, error_file: str, role: str) -> dict[str, str]:
    """``env`` plus torchrun's error file, NCCL error handling, role name and store flag.

    A user's own ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and signal list win, as under
    torchrun. ``TORCHELASTIC_USE_AGENT_STORE`` is "False", torchrun's value when its
    agent hosts no store: the agent here hosts none, so a script's ``env://``
    ``init_process_group`` has rank 0 host the TCPStore at ``MASTER_PORT``; "True"
    would make every rank a client of a server nobody started.
    """
    return {
        **env,
        ERROR_FILE_ENV: error_file,
        NCCL_ASYNC_ERROR_HANDLING_ENV: env.get(NCCL_ASYNC_ERROR_HANDLING_ENV, "1"),
        cfg.ROLE_NAME_ENV: role,
        USE_AGENT_STORE_ENV: "False",
        SIGNALS_TO_HANDLE_ENV: env.get(SIGNALS_TO_HANDLE_ENV, TORCHRUN_SIGNALS),
    }
