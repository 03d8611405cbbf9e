"""Acks: the files in which in-process workers and their agent tell each other things.

Worker to agent: which round it joined (:func:`write_ack`, from ``RoundFollower``; the
agent reads :func:`read_acks`), and the step after which it left because its node leaves
(:func:`write_left`, :func:`read_left`). Agent to workers: the node leaves, so leave at the
next step boundary (:func:`write_leave_note`, looked at every step with
:func:`leave_note`). Files, not etcd: they must work while etcd is out of reach, only the
local agent and workers read them, and a worker can afford a ``stat`` per step. An ack or
a left record counts only while the worker that wrote it is the one running (same PID),
so a replaced worker's old file is never taken for the new one's. Neither side imports
torch.
"""

from __future__ import annotations

import json
import os
from typing import Mapping


def ack_path(agent_dir: str, local_rank: int) -> str:
    """The file in which a worker tells its agent which round it has joined."""
    return os.path.join(agent_dir, f"worker-{local_rank}.json")


def write_ack(agent_dir: str, local_rank: int, round_number: int) -> None:
    """Atomically say: this process recovers in-process and has joined ``round_number``
    (-1: started, in no round yet)."""
    payload = {"pid": os.getpid(), "round": round_number, "in_process": True}
    _write_json(ack_path(agent_dir, local_rank), payload)


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


LEAVE_NOTE = "leave.json"
"""The agent's note in its folder: the node leaves at the workers' next step boundary."""


def write_leave_note(agent_dir: str, source: str) -> None:
    """Atomically tell the node's workers to leave after their next step (``source``:
    what asked the node to leave, for their events)."""
    _write_json(os.path.join(agent_dir, LEAVE_NOTE), {"source": source})


def leave_note(agent_dir: str) -> str | None:
    """What asked this node to leave, once its agent left the note; else None (one
    ``stat`` while there is none: workers look every step)."""
    path = os.path.join(agent_dir, LEAVE_NOTE)
    if not agent_dir or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return str(json.load(handle).get("source", "")) or "the agent"
    except (OSError, ValueError, AttributeError):
        return "the agent"


def left_path(agent_dir: str, local_rank: int) -> str:
    return os.path.join(agent_dir, f"worker-{local_rank}.left.json")


def write_left(agent_dir: str, local_rank: int, step: int) -> None:
    """Say: this worker left after ``step``, its state handed over; nothing follows."""
    _write_json(left_path(agent_dir, local_rank), {"pid": os.getpid(), "step": step})


def read_left(agent_dir: str, pids: list[int]) -> tuple[int | None, ...]:
    """Per local worker: the step after which it left at a boundary, or None."""
    found: list[int | None] = []
    for local_rank, pid in enumerate(pids):
        try:
            with open(left_path(agent_dir, local_rank), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            found.append(None)
            continue
        ok = isinstance(record, dict) and record.get("pid") == pid
        found.append(int(record["step"]) if ok else None)
    return tuple(found)


def _write_json(path: str, payload: Mapping[str, object]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    os.replace(tmp, path)
