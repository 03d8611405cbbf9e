"""How big each chaos job is and how fast the runtime reacts."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_rt.harness.env import REPO

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
"""The training every chaos job runs (one worker per node, in-process recovery)."""
TOLERANCE = 1e-5
"""How far final parameters may be from the reference run's."""


@dataclass(frozen=True)
class ChaosConfig:
    """How big each job is and how fast the runtime reacts."""

    steps: int = 60
    step_time: float = 0.05
    lease_ttl: int = 3
    collective_timeout: float = 6.0
    """Seconds a collective waits for a hung peer (2 x TTL: the runtime's rule, kept short)."""
    trial_timeout: float = 180.0
    every: int = 2
    """Checkpoint interval of the mid-checkpoint fault (small: a write is often in flight)."""
    max_restarts: int = 5
    """Worker failures a job absorbs (``--max-restarts``); membership changes are free."""
    script_args: tuple[str, ...] = ()
    """More flags for the training script (:data:`SCRIPT`)."""
