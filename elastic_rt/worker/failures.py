"""Telling a lost peer from a bug in the user's code.

Both arrive as exceptions out of a training step, and gloo raises a plain
``RuntimeError`` for a peer that died ("Connection closed by peer"), the same type as a
shape mismatch. So the loop asks two questions: *where* did it happen — in the runtime's
own collectives (gradient reduction, state broadcast, re-forming groups), which only fail
when a peer does, or in user code (the dataset, collate, the step, backward) — and, for
user code, does the exception chain carry a communication backend's error (c10d's
``DistError`` types, or the backends' messages). A user-code exception without one is
the user's bug: retrying it on every node would only repeat it, so the job ends at once
(:func:`end_job`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Iterator, NoReturn

import torch.distributed as dist

from elastic_rt.config import ERROR_FILE_ENV
from elastic_rt.errors import RoundAbandoned, StateLostError, StoreError, UserCodeError
from elastic_rt.events import EventSink
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.root_cause import write_error_file

logger = logging.getLogger(__name__)

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
        if isinstance(current, (dist.DistError, RoundAbandoned)):
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


def end_job(exc: UserCodeError | StateLostError, *, registry: RunRegistry | None,
            events: EventSink, round: int | None) -> NoReturn:
    """The user's code raised, or the job's state is gone: stop the job on every node
    instead of retrying it (or starting it over).

    The error file and the one-line root cause go out first: closing the run makes
    every agent stop its workers (this one too) and exit non-zero with that root
    cause; peers blocked in a collective with us fail, find the run closed and stop.
    Our agent prints the traceback from the error file in its root-cause report, as
    torchrun's does from ``@record``'s; it is printed here only if no file took it.

    Raises:
        UserCodeError, StateLostError: ``exc`` itself where there is no run to close (no
            ``registry``: outside ``elastic-rt launch``), so the script gets it.
        SystemExit: with code 1 once the run is closed.
    """
    if registry is None:
        raise exc
    is_user_code = isinstance(exc, UserCodeError)
    step = exc.step if isinstance(exc, UserCodeError) else None
    if not write_error_file(os.environ.get(ERROR_FILE_ENV, ""), exc.__cause__ or exc,
                            step=step) and is_user_code:
        logger.error("user code failed:", exc_info=exc.__cause__)
    why = "an error in the user's code" if is_user_code else "nothing left to restore from"
    logger.error("%s (%s: the job ends, it is not retried)", exc, why)
    events.emit("step.failed", round=round, step=step, error=str(exc))
    try:
        registry.close(f"failed: {exc}")
    except StoreError as store_exc:
        logger.warning("could not close the run: %s", store_exc)
    raise SystemExit(1) from None  # the job is over; its traceback is out
