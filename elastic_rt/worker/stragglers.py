"""Stragglers: a rank persistently slower than the others trains less of the same global batch.

Why: every step waits for its slowest rank, so one node with half the CPU (a noisy
neighbour, a throttled GPU, a bad disk under its loader) sets the whole job's pace.
DLRover excludes slow nodes at start-up only; here the shares follow the ranks' speeds
while the job runs, and the global batch, and so the result, stays exactly the same.

Rule, every ``window`` steps, on every data-parallel rank at the same step::

    all-gather (samples, compute seconds) of the window   one collective of 2 floats a rank
    max(t) / min(t) <= factor                             shares stay as they are
    else shares ∝ samples / seconds (each rank's speed),  the sampler re-splits the batch
         none below min_share of the fastest one's
         within 5 % of equal shares                       back to equal shares
    a rank at that floor whose t is still evict_factor    its node is evicted like a hung
    times the median's, evict_windows windows in a row    one, and rejoins through standby

``t`` is a rank's own forward and backward per step (the trainer's
``compute_seconds``), not its waits on peers. Where t grows with the samples, the
proportional rule settles at equal compute times (that is its fixed point). Where part
of t is fixed (rank 0's store and checkpoint threads, a user's per-step sleep), cutting
the share does not shorten it, and the rule would cut on to nothing: the floor stops it,
and eviction judges time per step at the floor, never the speed that a cut share lowers
(at equal shares a rank's speed there looked 5x the median's after a few windows).
Exact: the sampler only moves the boundaries between the ranks' parts of the same global
batch, and each rank's loss is weighted by its share (``worker/grad_sync.py``).

Does not cover the sharded and model-parallel trainers: their collectives run inside the
forward, so a fast rank's time includes waiting for the slow one (``compute_seconds`` is
None there and nothing is measured).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_rt.errors import ConfigError
from elastic_rt.worker import abort

WEIGHT_SCALE = 1000
"""Speeds become integer weights of up to this much (the fastest rank's)."""
EQUAL_WITHIN = 0.05
"""Weights this close (relative) to equal shares are equal shares."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Stragglers:
    """When the runtime moves samples away from a slow rank, and when it gives up on one."""

    window: int = 20
    """Steps over which each rank's speed is measured; 0 turns rebalancing off."""
    factor: float = 1.2
    """Rebalance once the slowest rank's compute time per step is this many times the
    fastest one's."""
    min_share: float = 0.25
    """No rank's share falls below this fraction of the fastest rank's."""
    evict_factor: float = 2.0
    """Evict a rank that, at the ``min_share`` floor, still takes this many times the
    median rank's compute time per step (so at least ``evict_factor / min_share`` times
    slower per sample: 8x by default); 0: never."""
    evict_windows: int = 3
    """How many windows in a row a rank must be that slow to be evicted."""

    def __post_init__(self) -> None:
        if (self.window < 0 or self.factor <= 1 or not 0 < self.min_share <= 1
                or self.evict_factor < 0 or self.evict_windows < 1):
            raise ConfigError(
                f"stragglers={self} needs window >= 0, factor > 1, 0 < min_share <= 1, "
                "evict_factor >= 0 and evict_windows >= 1",
                "For example Stragglers(window=20, factor=1.2, min_share=0.25, "
                "evict_factor=2, evict_windows=3).")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one window decided."""

    weights: tuple[int, ...] | None
    """The shares from now on (None: equal)."""
    speeds: tuple[float, ...]
    """Samples per compute second of each rank over the window (0: none trained)."""
    evict: int | None = None
    """The data-parallel rank to evict, if one stayed too slow."""


def plan(samples: Sequence[float], seconds: Sequence[float], current: tuple[int, ...] | None,
         slow_windows: list[int], options: Stragglers) -> Verdict:
    """Pure: the shares after a window, from every rank's samples and compute seconds
    under the ``current`` shares.

    ``slow_windows`` counts, per rank, the windows in a row it was too slow at the
    floor; it is updated in place.
    """
    speeds = tuple(n / t if t > 0 and n > 0 else 0.0 for n, t in zip(samples, seconds))
    floor = max(1, round(options.min_share * WEIGHT_SCALE))
    weights = current
    if min(seconds) > 0 and max(seconds) > options.factor * min(seconds):
        top = max(speeds)
        proposed = tuple(max(floor, round(WEIGHT_SCALE * s / top)) for s in speeds)
        is_equal = max(proposed) <= (1 + EQUAL_WITHIN) * min(proposed)
        weights = None if is_equal else proposed
    at_floor = [current is not None and w <= floor * max(current) / WEIGHT_SCALE
                for w in (current or [0] * len(seconds))]
    return Verdict(weights, speeds, _to_evict(seconds, at_floor, slow_windows, options))


def _to_evict(seconds: Sequence[float], at_floor: list[bool], slow_windows: list[int],
              options: Stragglers) -> int | None:
    """The rank that stayed at the floor share and still ``evict_factor`` times the median
    rank's time for ``evict_windows`` windows in a row, if any."""
    if not options.evict_factor or len(seconds) < 3:  # a median needs a majority
        return None
    limit = options.evict_factor * statistics.median(seconds)
    for rank, (spent, floored) in enumerate(zip(seconds, at_floor)):
        slow_windows[rank] = slow_windows[rank] + 1 if floored and spent > limit else 0
    worst = max(range(len(seconds)), key=lambda r: slow_windows[r])
    return worst if slow_windows[worst] >= options.evict_windows else None


@dataclass(slots=True)
class Balancer:
    """One rank's window of measurements and the agreement at its end."""

    options: Stragglers
    samples: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    slow_windows: list[int] = field(default_factory=list)

    def reset(self) -> None:
        """A new round: its ranks and shares are new, so is the window."""
        self.samples = self.seconds = 0.0
        self.steps = 0
        self.slow_windows = []

    def record(self, samples: int, compute_s: float | None) -> bool:
        """Count one step; whether the window is full (every rank's is at the same step)."""
        if not self.options.window or compute_s is None:
            return False
        self.samples += samples
        self.seconds += compute_s
        self.steps += 1
        return self.steps >= self.options.window

    def agree(self, group: dist.ProcessGroup, current: tuple[int, ...] | None) -> Verdict:
        """Gather every rank's window and decide, the same on every rank.

        Raises:
            RoundAbandoned: a newer round dropped a member while this waited.
            RuntimeError: a peer's connection failed.
        """
        size = dist.get_world_size(group)
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(size)]
        mine = torch.tensor([self.samples, self.seconds], dtype=torch.float64)
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        assert work is not None  # async_op=True always returns a Work
        abort.wait(work.get_future())
        if len(self.slow_windows) != size:
            self.slow_windows = [0] * size
        verdict = plan([float(t[0]) for t in gathered], [float(t[1]) for t in gathered],
                       current, self.slow_windows, self.options)
        self.samples = self.seconds = 0.0
        self.steps = 0
        return verdict
