"""Read the files in which in-process workers tell their agent which round they joined.

The worker side writes them (:meth:`elastic_rt.membership.RoundFollower.acknowledge`);
an ack counts only while the worker that wrote it is the one running (same PID).
"""

from __future__ import annotations

import json

from elastic_rt.membership import ack_path


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
