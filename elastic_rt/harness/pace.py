"""Simulated compute that a test switches off once it has seen what it waited for.

Join and fence tests slow the examples' steps only so that a node starting late (importing
torch on two busy cores: 5-25 s) is admitted before the others finish. Sized for the slowest
case, the job then kept that pace long after the admission: two thirds of those tests' time.
Given ``until``, the pause lasts only until that file exists; the test creates it when the
event it waits for is in the log, and the job runs its remaining steps at full speed. The
steps' results do not depend on the pause, so a release never changes what a test compares.
"""

from __future__ import annotations

import os
import time


class SimulatedCompute:
    """Sleeps ``seconds`` per step until the file ``until`` (if given) exists."""

    def __init__(self, seconds: float, until: str | None = None) -> None:
        self.seconds = seconds
        self.until = until
        self.released = not seconds

    def __call__(self) -> None:
        if self.released:
            return
        if self.until and os.path.exists(self.until):
            self.released = True
            return
        time.sleep(self.seconds)
