"""A node's place in a round -> the environment of each local worker.

The values are :class:`~elastic_rt.config.WorkerEnv`, written with its ``to_env`` (the
one path: the library reads the same class back with ``from_env``). Workers in a
round get torchrun's variables, so an unmodified torchrun script runs; workers
started in standby (outside any round) get no rank until a round admits them.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from elastic_rt.config import WorkerEnv
from elastic_rt.rendezvous.rounds import Round


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
