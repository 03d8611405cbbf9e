"""The soak's fault kinds and knobs: how many faults, how often, how big the job is."""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_rt.harness.chaos.config import ChaosConfig

KINDS = ("node-kill", "agent-leave", "node-stop", "worker-kill", "netns-cut", "etcd-restart")
"""The faults drawn, uniformly, one every ``interval`` seconds or so."""
JOIN = "node-join"
"""Not drawn: every node a ``node-kill`` or ``agent-leave`` takes out is replaced at once by
a fresh ``elastic-rt launch`` under a new node id, and each such start is counted as a fault."""
LOSSES = frozenset({"node-kill", "agent-leave", "node-stop", "netns-cut"})
"""The kinds that take a node out of the round (for good, or until it is back and fenced)."""


@dataclass(frozen=True)
class SoakConfig:
    """One soak: its faults, its job, and how long anything may take."""

    faults: int = 500
    interval: float = 2.5
    """Mean seconds from one fault's end to the next one (drawn uniformly from 0.5x-1.5x)."""
    seed: int = 0
    nodes: int = 4
    """Nodes started at first; the job is ``--nnodes MIN:nodes``."""
    min_nodes: int = 2
    steps: int = 0
    """Training steps; 0: sized from the faults (:meth:`sized_steps`)."""
    step_time: float = 0.5
    """Simulated compute per step (s). Long runs need few steps: even in float64 a job's
    difference to the 1-rank reference grows about tenfold every 2,000 steps late in
    training (AdamW at lr 1e-2 never settles), from 1e-14 at 3,000 steps to 4e-3 at
    29,000 with no jump at any fault (a 173-fault soak at 0.05 s per step); at 0.5 s a
    500-fault soak takes ~6,000 steps."""
    lease_ttl: int = 3
    collective_timeout: float = 600.0
    """A collective blocked on a dead peer never times out within the soak (NCCL's way):
    only the runtime's own failure handling frees it."""
    pause_s: tuple[float, float] = (0.5, 3.0)
    """A node-stop or netns-cut lasts the heartbeat window (which evicts the node) plus a
    time drawn from this range: past the TTL less 1 s, the node fences itself while cut
    off; sooner, it finds its lease revoked when it runs or reaches etcd again."""
    step_overhead_s: float = 0.06
    """What a step takes beyond ``step_time`` while faults land (measured on 2 busy
    cores with 4 nodes: 9 steps/s at 0.05 s); with the next figure it sizes ``steps``."""
    seconds_per_fault: float = 3.0
    """What a fault takes beyond ``interval``: its own pause, and its wait for a place
    (a replacement joining); measured over soaks of 30 faults."""
    hold_timeout: float = 120.0
    """The longest a fault may wait for its precondition (a replacement joining)."""
    give_way_s: float | None = None
    """After waiting this long for a place, a fault gives way to one of a kind that can
    land now (None: it waits, up to ``hold_timeout``). The short soak in the suite uses it
    to land its faults within a training of two minutes, whatever the machine's load
    does to the replacements' start (5-20 s to import torch on 2 busy cores)."""
    stall_timeout: float = 60.0
    """Seconds without a new step after which the soak stops as hung (a problem): a
    recovery takes a fraction of a second, and the longest wait seen was 8 s."""
    kinds: tuple[str, ...] = KINDS
    dtype: str = "float64"
    """Of the model and data. In float32 a 4-rank job without any fault ends 2e-5 from the
    1-rank reference after 3,000 steps (its gradient sums are added in another order);
    in float64 it ends 1.3e-14 from it, so the 1e-5 bar sees only what faults did."""

    @property
    def sized_steps(self) -> int:
        """``steps``, or enough that training outlasts the faults, with a fifth to spare."""
        if self.steps:
            return self.steps
        seconds = self.faults * (self.interval + self.seconds_per_fault) * 1.2
        return math.ceil((seconds + 30) * self.steps_per_s)

    @property
    def steps_per_s(self) -> float:
        return 1.0 / (self.step_time + self.step_overhead_s)

    @property
    def nnodes(self) -> str:
        return f"{self.min_nodes}:{self.nodes}"

    def chaos(self) -> ChaosConfig:
        """The settings the chaos harness's :class:`~..chaos.trial.Job` starts nodes with."""
        return ChaosConfig(steps=self.sized_steps, step_time=self.step_time,
                           lease_ttl=self.lease_ttl, collective_timeout=self.collective_timeout,
                           trial_timeout=600.0 + self.sized_steps * self.step_time,
                           max_restarts=self.faults + 10, script_args=("--dtype", self.dtype))

    def reference(self) -> ChaosConfig:
        """The reference run's: the same steps with no simulated compute (it only has to
        end with the same parameters, and sooner)."""
        return ChaosConfig(steps=self.sized_steps, step_time=0.0,
                           trial_timeout=600.0 + self.sized_steps * 0.05,
                           script_args=("--dtype", self.dtype))
