"""Stragglers: a rank persistently slower than the others trains less of the same global batch.

Why: every step waits for its slowest rank, so one node with half the CPU (a noisy
neighbour, a throttled GPU, a bad disk under its loader) sets the whole job's pace.
DLRover excludes slow nodes at start-up only; here the shares follow the ranks' speeds
while the job runs, and the global batch, and so the result, stays exactly the same.

What is measured: each rank's *busy* seconds per step, the step's wall time (its data,
forward, backward, optimizer step, events) less the time it spent blocked on its peers
(every collective the loop waits on goes through ``abort.wait``, which times it). A
rank's busy time is not all proportional to its samples: its optimizer step, its part of
each collective, its bookkeeping are the same whatever its share, and on a slow rank they
are slow too. So each rank's busy time is fitted as ``fixed + samples * per_sample`` over
its last two windows of steps, whose shares differ once they have been moved.

Rule, every ``window`` steps, on every data-parallel rank at the same step::

    all-gather each rank's (samples, busy) of its last 2 windows   2 floats a step a rank
    equal shares and max(busy) / min(busy) <= factor               shares stay as they are
    moved shares, max(busy) / min(busy) <= 1.1 and a rank           shares stay as they are
         without a line
    else, per rank: busy = fixed + samples * per_sample,    a least-squares line over the
         median busy time of each share the steps had      one share (or a line that is not
         (of its latest half window of steps);              a rising one): proportional,
                                                            fixed = 0, per_sample = busy / samples
         shares of the same global batch that equalize the predicted busy times, none
         below min_share of the largest
         within 5 % of equal shares                         back to equal shares
         within 5 % of the current shares                   shares stay as they are
    a rank at that floor whose busy time is still           its node is evicted like a hung
    evict_factor times the median's, evict_windows          one, and rejoins through standby
    windows in a row

Medians, not means: a shared host stalls a step now and then (0.3-0.7 s on two cores),
and one such step in a window of 20 moved a mean by a fifth. The first rebalancing has a
single share to go on, so it is the proportional rule: a slow rank whose fixed work is
slow too keeps too much (measured: 0.71 of the fault-free pace in one run where the
proportional rule was all there was); the next windows see two shares and fit the line.
Where the fixed part cannot be shortened at all (rank 0's store and checkpoint threads, a
user's per-step sleep) the fit says so, and the floor stops the cut; eviction judges time
per step at the floor, never the speed that a cut share lowers.
Exact: the sampler only moves the boundaries between the ranks' parts of the same global
batch, and each rank's loss is weighted by its share (``worker/grad_sync.py``).

Does not cover the sharded and model-parallel trainers: their collectives run inside the
forward, where the loop does not time them (``compute_seconds`` is None there and nothing
is measured).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_rt.errors import ConfigError
from elastic_rt.worker import abort

WEIGHT_SCALE = 1000
"""Shares become integer weights of up to this much (the largest share's)."""
EQUAL_WITHIN = 0.05
"""Weights this close (relative) to equal shares are equal shares, and this close to the
current shares are the current shares."""
HISTORY_WINDOWS = 2
"""Windows of steps a rank's line is fitted over: the one just ended and the one before,
under other shares once they moved."""
REFINE_PAST = 1 + 2 * EQUAL_WITHIN
"""Shares already moved are moved again once the slowest rank's busy time is this many
times the fastest one's (equal shares: ``Stragglers.factor``)."""
MIN_SPREAD = 0.05
"""Shares that differ by less than this (relative) give no line: one share, proportional."""

Point = tuple[float, float]
"""One step of one rank: (samples, busy seconds)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Stragglers:
    """When the runtime moves samples away from a slow rank, and when it gives up on one."""

    window: int = 20
    """Steps over which each rank's speed is measured; 0 turns rebalancing off."""
    factor: float = 1.2
    """Rebalance equal shares once the slowest rank's busy time per step is this many
    times the fastest one's."""
    min_share: float = 0.25
    """No rank's share falls below this fraction of the largest share."""
    evict_factor: float = 2.0
    """Evict a rank that, at the ``min_share`` floor, still takes this many times the
    median rank's busy time per step (so at least ``evict_factor / min_share`` times
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
    """Samples per busy second of each rank over the window (0: none trained)."""
    evict: int | None = None
    """The data-parallel rank to evict, if one stayed too slow."""


@dataclass(frozen=True, slots=True)
class Fit:
    """A rank's busy seconds per step as ``fixed + samples * per_sample``."""

    fixed: float
    per_sample: float


def fit(points: Sequence[Point], recent: int) -> Fit | None:
    """Pure: the least-squares line through the median busy time of each share the steps
    (oldest first) had, over its ``recent`` latest steps, weighted by their number;
    None with one share, or a line that does not rise from a fixed part of at least zero
    (noise, not a measurement).

    Only a share's latest steps: its older ones may be from before the rank's speed
    changed. Seen: a node limited mid-window, whose whole window's median was half fast,
    gave a line that fell with more samples, and its share stayed where the first,
    proportional rebalancing had put it (0.71 of the pace).
    """
    levels: dict[float, list[float]] = collections.defaultdict(list)
    for samples, busy in points:
        if samples > 0:
            levels[samples].append(busy)
    levels = {x: b[-recent:] for x, b in levels.items()}
    if len(levels) < 2 or max(levels) - min(levels) < MIN_SPREAD * max(levels):
        return None
    xs, ys, ws = zip(*((x, statistics.median(b), len(b)) for x, b in levels.items()))
    total = sum(ws)
    mean_x = sum(w * x for w, x in zip(ws, xs)) / total
    mean_y = sum(w * y for w, y in zip(ws, ys)) / total
    spread = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys)) / spread
    fixed = mean_y - slope * mean_x
    return Fit(fixed, slope) if slope > 0 and fixed >= 0 else None


def equal_busy(fits: Sequence[Fit], total: float, min_share: float) -> list[float]:
    """Pure: samples per rank, summing to ``total``, whose predicted busy times are equal,
    none below ``min_share`` of the largest (those at the floor take it; the others share
    the rest so that theirs are equal).

    At a common busy time ``level`` each rank takes ``(level - fixed) / per_sample``, or
    the floor; their sum grows with ``level``, which a bisection finds.
    """
    def shares_at(level: float) -> list[float]:
        free = [(level - f.fixed) / f.per_sample for f in fits]
        floor = min_share * max(free)
        return [max(n, floor) for n in free]

    low = min(f.fixed for f in fits)
    high = max(f.fixed + f.per_sample * total for f in fits)
    for _ in range(100):  # the bracket shrinks to a float's precision
        middle = (low + high) / 2
        low, high = (middle, high) if sum(shares_at(middle)) < total else (low, middle)
    return shares_at(high)


def plan(points: Sequence[Sequence[Point]], current: tuple[int, ...] | None,
         slow_windows: list[int], options: Stragglers) -> Verdict:
    """Pure: the shares after a window, from every rank's (samples, busy) per step over
    its last windows (the one just ended last) under the ``current`` shares.

    ``slow_windows`` counts, per rank, the windows in a row it was too slow at the
    floor; it is updated in place.
    """
    latest = [rank[-options.window:] if options.window else rank for rank in points]
    samples = [statistics.median(s for s, _ in w) if w else 0.0 for w in latest]
    busy = [statistics.median(b for _, b in w) if w else 0.0 for w in latest]
    speeds = tuple(n / t if t > 0 and n > 0 else 0.0 for n, t in zip(samples, busy))
    floor = max(1, round(options.min_share * WEIGHT_SCALE))
    at_floor = [current is not None and w <= floor * max(current) / WEIGHT_SCALE
                for w in (current or [0] * len(busy))]
    verdict = Verdict(current, speeds, _to_evict(busy, at_floor, slow_windows, options))
    if min(speeds) <= 0:
        return verdict  # a rank trained nothing (its state landing): nothing to go on
    fits = [fit(rank, max(1, options.window // 2)) for rank in points]
    is_fitted = all(f is not None for f in fits)
    # Equal shares move past ``factor``; shares already moved are refined past a smaller
    # gap, or whenever every rank has a line (a share that stopped short stays put else).
    gap = options.factor if current is None else min(options.factor, REFINE_PAST)
    if not (max(busy) > gap * min(busy) or (current is not None and is_fitted)):
        return verdict
    lines = [f or Fit(0.0, t / n) for f, n, t in zip(fits, samples, busy)]
    shares = equal_busy(lines, sum(samples), options.min_share)
    top = max(shares)
    proposed = tuple(max(floor, round(WEIGHT_SCALE * n / top)) for n in shares)
    if _within(proposed, (1,) * len(proposed)):
        return dataclasses.replace(verdict, weights=None)
    if current is not None and _within(proposed, current):
        return verdict
    return dataclasses.replace(verdict, weights=proposed)


def _within(a: Sequence[int], b: Sequence[int]) -> bool:
    """Shares ``a`` and ``b`` give every rank the same part of the batch, within
    ``EQUAL_WITHIN`` of it."""
    fa = [x / sum(a) for x in a]
    fb = [x / sum(b) for x in b]
    return all(abs(x - y) <= EQUAL_WITHIN * y for x, y in zip(fa, fb))


def _to_evict(busy: Sequence[float], at_floor: list[bool], slow_windows: list[int],
              options: Stragglers) -> int | None:
    """The rank that stayed at the floor share and still ``evict_factor`` times the median
    rank's busy time for ``evict_windows`` windows in a row, if any."""
    if not options.evict_factor or len(busy) < 3:  # a median needs a majority
        return None
    limit = options.evict_factor * statistics.median(busy)
    for rank, (spent, floored) in enumerate(zip(busy, at_floor)):
        slow_windows[rank] = slow_windows[rank] + 1 if floored and spent > limit else 0
    worst = max(range(len(busy)), key=lambda r: slow_windows[r])
    return worst if slow_windows[worst] >= options.evict_windows else None


@dataclass(slots=True)
class Balancer:
    """One rank's steps of the last windows and the agreement at each window's end."""

    options: Stragglers
    history: collections.deque[Point] = field(init=False)
    steps: int = 0
    """Steps since the last agreement."""
    slow_windows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history = collections.deque(maxlen=max(1, HISTORY_WINDOWS * self.options.window))

    def reset(self) -> None:
        """A new round: its ranks and shares are new, so is the history."""
        self.history.clear()
        self.steps = 0
        self.slow_windows = []

    def record(self, samples: int, busy_s: float | None) -> bool:
        """Count one step; whether the window is full (every rank's is at the same step)."""
        if not self.options.window or busy_s is None:
            return False
        self.history.append((float(samples), busy_s))
        self.steps += 1
        return self.steps >= self.options.window

    def agree(self, group: dist.ProcessGroup, current: tuple[int, ...] | None) -> Verdict:
        """Gather every rank's history and decide, the same on every rank.

        Raises:
            RoundAbandoned: a newer round dropped a member while this waited.
            RuntimeError: a peer's connection failed.
        """
        size, capacity = dist.get_world_size(group), self.history.maxlen or 0
        gathered = [torch.zeros(1 + 2 * capacity, dtype=torch.float64) for _ in range(size)]
        mine = torch.zeros(1 + 2 * capacity, dtype=torch.float64)
        mine[0] = len(self.history)
        if self.history:
            mine[1:1 + 2 * len(self.history)] = torch.tensor(
                [v for point in self.history for v in point], dtype=torch.float64)
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        assert work is not None  # async_op=True always returns a Work
        abort.wait(work.get_future())
        if len(self.slow_windows) != size:
            self.slow_windows = [0] * size
        points = [[(float(t[1 + 2 * k]), float(t[2 + 2 * k])) for k in range(int(t[0]))]
                  for t in gathered]
        self.steps = 0
        return plan(points, current, self.slow_windows, self.options)
