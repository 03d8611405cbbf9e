"""The agent's one-off etcd calls, tried again while a cluster member restarts.

A member that restarts resets the streams in flight ("Stream removed", "leader
changed"), and the next call goes to another member; a leader's restart fails calls on
every member for the second or two of an election. Raised, one such failure ended the
agent and the job lost the node with no fault on it (docs/soak.md findings 12 and 17).
The agent's loop reads the run again on its own after a failed read; the calls here are
those it makes once, in the middle of carrying out a decision.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from elastic_rt.errors import StoreConnectionError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def again(call: Callable[[], T], what: str, *, within: float,
          sleep: Callable[[float], None] = time.sleep, poll: float = 0.1) -> T:
    """``call()``, tried again every ``poll`` seconds while etcd fails it with a
    connection error, for up to ``within`` seconds. A write here must be one that may
    land twice (a put, a compare on a value we wrote): a reset can hide that the first
    went through.

    Raises:
        StoreConnectionError: etcd still failed the call after ``within`` seconds.
        StoreError: any other store error, at once (it would fail again).
    """
    deadline = time.monotonic() + within
    failed = 0
    while True:
        try:
            return call()
        except StoreConnectionError as exc:
            failed += 1
            if time.monotonic() >= deadline:
                raise
            if failed == 1:
                logger.warning("etcd failed %s (%s); trying again for up to %g s", what, exc,
                               within)
        sleep(poll)
