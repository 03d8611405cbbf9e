"""Acks: the files in which in-process workers tell their agent which round they joined.

One side each: a worker writes (:func:`write_ack`, from ``RoundFollower``), its agent
reads (:func:`read_acks`). A file, not etcd: the agent needs it even while etcd is out of
reach, and only the local agent reads it. An ack counts only while the worker that wrote
it is the one running (same PID), so a replaced worker's old ack is never taken for the
new one's. Neither side imports torch.
"""

from __future__ import annotations

import json
import os


def ack_path(agent_dir: str, local_rank: int) -> str:
    """The file in which a worker tells its agent which round it has joined."""
    return os.path.join(agent_dir, f"worker-{local_rank}.json")


def write_ack(agent_dir: str, local_rank: int, round_number: int) -> None:
    """Atomically say: this process recovers in-process and has joined ``round_number``
    (-1: started, in no round yet)."""
    path = ack_path(agent_dir, local_rank)
    payload = {"pid": os.getpid(), "round": round_number, "in_process": True}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    os.replace(tmp, path)


def read_acks(agent_dir: str, pids: list[int]) -> tuple[int | None, ...]:
    """Per local worker: the round it acknowledged as an in-process worker, or None."""
    return tuple(_read(agent_dir, local_rank, pid) for local_rank, pid in enumerate(pids))


def _read(agent_dir: str, local_rank: int, pid: int) -> int | None:
    try:
        with open(ack_path(agent_dir, local_rank), encoding="utf-8") as handle:
            ack = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(ack, dict) or ack.get("pid") != pid or not ack.get("in_process"):
        return None
    return int(ack["round"])
