"""Polling a condition with a deadline: the one way the harness waits for processes.

Tests, benchmarks and the chaos matrix watch other processes through files and
process tables, which offer nothing to block on; so they poll, and every poll has a
deadline and names what it waited for when that deadline passes.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """A condition stayed false until its deadline."""


def wait_until(condition: Callable[[], T | None], timeout: float, what: str,
               interval: float = 0.1) -> T:
    """Call ``condition`` every ``interval`` s until it returns something truthy; return that.

    Raises:
        WaitTimeout: ``timeout`` seconds passed first; the message names ``what``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {what}")
