"""Stragglers: the shares after a window, from every rank's samples and busy time per step."""

from __future__ import annotations

import pytest

from elastic_rt.errors import ConfigError
from elastic_rt.worker.stragglers import (
    WEIGHT_SCALE,
    Balancer,
    Fit,
    Stragglers,
    equal_busy,
    fit,
    plan,
)

OPTIONS = Stragglers(window=20, factor=1.2, min_share=0.25, evict_factor=2.0, evict_windows=2)
GLOBAL = 3072


def steps(samples: float, busy: float, n: int = 20) -> list[tuple[float, float]]:
    return [(samples, busy)] * n


def window(samples: list[float], busy: list[float]) -> list[list[tuple[float, float]]]:
    """One window of identical steps per rank."""
    return [steps(n, t) for n, t in zip(samples, busy)]


def test_ranks_within_the_factor_keep_their_shares() -> None:
    verdict = plan(window([8, 8, 8], [1.0, 1.1, 1.15]), None, [0, 0, 0], OPTIONS)
    assert verdict.weights is None and verdict.evict is None
    kept = plan(window([5, 5, 14], [1.0, 1.0, 1.1]), (1000, 1000, 2800), [0, 0, 0], OPTIONS)
    assert kept.weights == (1000, 1000, 2800)  # balanced already: nothing moves


def test_a_slow_rank_gets_a_share_in_proportion_to_its_speed_from_a_single_share() -> None:
    verdict = plan(window([8, 8, 8], [0.05, 0.05, 0.1]), None, [0, 0, 0], OPTIONS)
    assert verdict.weights == (1000, 1000, 500)
    assert verdict.speeds == (160.0, 160.0, 80.0)


def test_a_straggler_that_recovers_goes_back_to_an_equal_share() -> None:
    # its small share now takes it far less time than the others' take them
    verdict = plan(window([9.6, 9.6, 4.8], [0.06, 0.06, 0.03]), (1000, 1000, 500), [0, 0, 0],
                   OPTIONS)
    assert verdict.weights is None


def busy_of(fixed: float, per_sample: float):
    return lambda n: fixed + per_sample * n


def rebalanced(ranks, windows: int, options: Stragglers = OPTIONS
               ) -> tuple[tuple[int, ...] | None, list[float]]:
    """Run ``windows`` windows of ranks whose busy time is ``ranks[r](samples)``; the
    final weights and each rank's busy time under them."""
    history: list[list[tuple[float, float]]] = [[] for _ in ranks]
    weights: tuple[int, ...] | None = None
    slow = [0] * len(ranks)
    for _ in range(windows):
        shares = [1] * len(ranks) if weights is None else list(weights)
        samples = [GLOBAL * w / sum(shares) for w in shares]
        for rank, busy in enumerate(ranks):
            history[rank] = (history[rank] + steps(samples[rank], busy(samples[rank])))[-40:]
        weights = plan(history, weights, slow, options).weights
    shares = [1] * len(ranks) if weights is None else list(weights)
    samples = [GLOBAL * w / sum(shares) for w in shares]
    return weights, [busy(n) for busy, n in zip(ranks, samples)]


def test_a_slow_rank_whose_fixed_work_is_slow_too_is_balanced_on_its_busy_time() -> None:
    """c at half speed in everything: its forward and backward per sample, and its
    optimizer step and collectives' share, which a smaller share does not shorten.
    Equal compute times (the proportional rule's fixed point) leave it slower by its
    fixed part; fitting the line over two windows of different shares removes that."""
    fast, slow = busy_of(0.02, 5e-5), busy_of(0.04, 1e-4)
    weights, busy = rebalanced([fast, fast, slow], windows=1)
    assert weights == (1000, 1000, 500)  # one share to go on: proportional
    assert max(busy) / min(busy) > 1.1  # under-corrected: c still 14 % slower
    weights, busy = rebalanced([fast, fast, slow], windows=4)
    assert weights is not None and weights[2] < 450
    assert max(busy) / min(busy) < 1.02, busy  # equal busy times: every rank on time


def test_the_line_is_fitted_through_each_shares_median_so_a_stalled_step_moves_nothing(
) -> None:
    points = steps(1024, 0.1) + steps(1200, 0.11)
    points[3] = (1024, 0.7)  # a stall of the shared host
    line = fit(points, 20)
    assert line is not None
    assert line.fixed == pytest.approx(0.1 - 1024 * line.per_sample)
    assert line.per_sample == pytest.approx(0.01 / 176)


@pytest.mark.parametrize("points", [
    steps(1024, 0.1) * 2,  # one share: no line
    steps(1024, 0.1) + steps(1040, 0.2),  # shares 1.5 % apart: noise
    steps(1024, 0.2) + steps(1200, 0.1),  # falling with more samples: noise
    steps(1024, 0.1) + steps(2048, 0.3),  # through zero below no samples: not a fixed part
])
def test_no_line_where_the_steps_cannot_give_one(points: list[tuple[float, float]]) -> None:
    assert fit(points, 20) is None


def test_equal_busy_shares_sum_to_the_batch_and_respect_the_floor() -> None:
    fits = [Fit(0.02, 5e-5), Fit(0.02, 5e-5), Fit(0.04, 1e-4)]
    shares = equal_busy(fits, GLOBAL, 0.25)
    assert sum(shares) == pytest.approx(GLOBAL)
    times = [f.fixed + f.per_sample * n for f, n in zip(fits, shares)]
    assert max(times) - min(times) == pytest.approx(0, abs=1e-12)
    hopeless = [Fit(0.0, 1e-5), Fit(0.0, 1e-5), Fit(1.0, 1e-5)]  # fixed 1 s: never on time
    floored = equal_busy(hopeless, GLOBAL, 0.25)
    assert sum(floored) == pytest.approx(GLOBAL)
    assert floored[2] == pytest.approx(0.25 * floored[0]) and floored[0] == floored[1]


def test_a_rank_far_too_slow_is_floored_then_evicted_after_its_windows() -> None:
    slow = [0, 0, 0, 0]
    first = plan(window([8] * 4, [1.0, 1.0, 1.0, 10.0]), None, slow, OPTIONS)  # 10x slower
    assert first.weights == (1000, 1000, 1000, 250) and first.evict is None  # floored first
    at_floor = window([8, 8, 8, 2], [1.0, 1.0, 1.0, 2.5])
    assert plan(at_floor, first.weights, slow, OPTIONS).evict is None
    assert plan(at_floor, first.weights, slow, OPTIONS).evict == 3
    assert plan(window([8] * 4, [1.0] * 4), None, slow, OPTIONS).evict is None
    assert slow == [0] * 4


def test_a_fixed_overhead_the_share_cannot_shorten_is_floored_not_evicted() -> None:
    """Rank 0 spends 0.01 s a step on its own (store, checkpoints) beside samples that
    cost almost nothing: cutting its share cannot make it as fast as the others. Its
    share falls to the floor and stays there (1.5x the others' time), and it is not
    evicted for it: at the floor it is not twice as slow as the median."""
    ranks = [busy_of(0.01, 1e-6), busy_of(0.0, 1e-6), busy_of(0.0, 1e-6)]
    weights, busy = rebalanced(ranks, windows=10)
    assert weights == (WEIGHT_SCALE // 4, 1000, 1000)


def test_two_ranks_never_evict_one_another() -> None:
    slow = [0, 0]
    for _ in range(5):
        assert plan(window([8, 2], [1.0, 10.0]), (1000, 250), slow, OPTIONS).evict is None


def test_a_rank_that_trained_nothing_moves_no_share() -> None:
    verdict = plan(window([0, 8, 8], [0.01, 0.05, 0.1]), None, [0, 0, 0], OPTIONS)
    assert verdict.weights is None


def test_a_window_is_full_after_its_steps_and_none_is_measured_without_times() -> None:
    balancer = Balancer(Stragglers(window=3))
    assert [balancer.record(8, 0.1) for _ in range(3)] == [False, False, True]
    assert not Balancer(Stragglers(window=3)).record(8, None)
    assert not Balancer(Stragglers(window=0)).record(8, 0.1)
    assert balancer.history.maxlen == 6  # two windows: the line needs two shares


@pytest.mark.parametrize("bad", [dict(window=-1), dict(factor=1.0), dict(min_share=0),
                                 dict(evict_factor=-1), dict(evict_windows=0)])
def test_bad_settings_are_one_clear_error(bad: dict) -> None:
    with pytest.raises(ConfigError):
        Stragglers(**bad)


def test_a_rank_slowed_mid_window_is_fitted_on_each_shares_latest_steps() -> None:
    """c is held to half its speed half-way through the window before the first
    rebalancing: the older half of that share's steps is from before."""
    fast, slow = busy_of(0.02, 5e-5), busy_of(0.04, 1e-4)
    points = steps(1024, fast(1024), 10) + steps(1024, slow(1024), 10) + steps(700, slow(700))
    line = fit(points, 10)
    assert line is not None
    assert line.fixed == pytest.approx(0.04) and line.per_sample == pytest.approx(1e-4)
    assert fit(points, 20) is None  # the whole window's median: a line falling with samples


def test_moved_shares_are_refined_past_a_smaller_gap_than_equal_ones() -> None:
    gap = window([8, 8, 5], [1.0, 1.0, 1.15])  # 15 % slower: under the factor, over 10 %
    assert plan(gap, None, [0, 0, 0], OPTIONS).weights is None
    assert plan(gap, (1000, 1000, 625), [0, 0, 0], OPTIONS).weights == (1000, 1000, 543)
