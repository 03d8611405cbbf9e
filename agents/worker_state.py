"""How a node's workers stand, as plain values: what the policy reads, with no process in it.

:mod:`agents.processes` produces these from the real processes; the pure policy
(:mod:`agents.policy`) and the simulators read them without importing psutil or
subprocess.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WorkerState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class WorkerExit:
    local_rank: int
    pid: int
    exitcode: int
    """Negative for a signal, as in subprocess."""
