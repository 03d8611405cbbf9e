"""Telling a lost peer from a bug in the user's code.

Both arrive as exceptions out of a training step, and gloo raises a plain
``RuntimeError`` for a peer that died ("Connection closed by peer"), the same type as a
shape mismatch. So the loop asks two questions: *where* did it happen — in the runtime's
own collectives (gradient reduction, state broadcast, re-forming groups), which only fail
when a peer does, or in user code (the dataset, collate, the step, backward) — and, for
user code, does the exception chain carry a communication backend's error (c10d's
``DistError`` types, or the backends' messages). A user-code exception without one is
the user's bug: retrying it on every node would only repeat it, so the job ends at once.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch.distributed as dist

from elastic_rt.errors import UserCodeError

_BACKEND_MESSAGES = re.compile(
    r"gloo|nccl|c10d|ProcessGroup|Connection closed by peer|Connection reset by peer"
    r"|Broken pipe|Socket Timeout|timed out after|Watchdog caught collective",
    re.IGNORECASE,
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (raised from user code) comes from a failed collective."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        if _BACKEND_MESSAGES.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def user_code(*, rank: int, step: int) -> Iterator[None]:
    """Turn an exception that is not a failed collective into a :class:`UserCodeError`."""
    try:
        yield
    except Exception as exc:
        if is_peer_failure(exc):
            raise
        raise UserCodeError(_one_line(exc), rank=rank, step=step) from exc
