"""A round and a node -> the environment of each local worker.

torchrun's variables, so an unmodified torchrun script runs, plus ``ELASTIC_RT_*``
extras that the library reads to join in-process recovery.
"""

from __future__ import annotations

from typing import Mapping

from elastic_rt import config as cfg
from elastic_rt.rendezvous.rounds import Round


def worker_envs(
    base: Mapping[str, str],
    round_: Round,
    node_id: str,
    *,
    run_id: str,
    master: tuple[str, int],
    restart_count: int,
    max_restarts: int,
    extras: Mapping[str, str],
) -> list[dict[str, str]]:
    """One environment per local worker of ``node_id`` in ``round_``."""
    nproc = round_.nprocs[round_.group_rank(node_id)]
    offset = round_.rank_offset(node_id)
    shared = {
        **base,
        **extras,
        cfg.WORLD_SIZE_ENV: str(round_.world_size),
        cfg.LOCAL_WORLD_SIZE_ENV: str(nproc),
        cfg.GROUP_RANK_ENV: str(round_.group_rank(node_id)),
        cfg.GROUP_WORLD_SIZE_ENV: str(len(round_.members)),
        cfg.ROLE_NAME_ENV: "default",
        cfg.ROLE_WORLD_SIZE_ENV: str(round_.world_size),
        cfg.MASTER_ADDR_ENV: master[0],
        cfg.MASTER_PORT_ENV: str(master[1]),
        cfg.RESTART_COUNT_ENV: str(restart_count),
        cfg.MAX_RESTARTS_ENV: str(max_restarts),
        cfg.RUN_ID_ENV: run_id,
        cfg.NODE_ID_ENV: node_id,
        cfg.ROUND_ENV: str(round_.number),
        cfg.TOKEN_ENV: str(round_.token),
        "PYTHONUNBUFFERED": "1",
    }
    envs = []
    for local_rank in range(nproc):
        rank = str(offset + local_rank)
        envs.append(
            {**shared, cfg.RANK_ENV: rank, cfg.ROLE_RANK_ENV: rank, cfg.LOCAL_RANK_ENV: str(local_rank)}
        )
    return envs
