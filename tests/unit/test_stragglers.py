"""Stragglers: the shares after a window, from every rank's samples and compute time."""

from __future__ import annotations

import pytest

from elastic_rt.errors import ConfigError
from elastic_rt.worker.stragglers import Balancer, Stragglers, plan

OPTIONS = Stragglers(window=20, factor=1.2, min_share=0.25, evict_factor=2.0, evict_windows=2)


def test_ranks_within_the_factor_keep_their_shares() -> None:
    verdict = plan([160, 160, 160], [1.0, 1.1, 1.15], None, [0, 0, 0], OPTIONS)
    assert verdict.weights is None and verdict.evict is None
    kept = plan([100, 100, 280], [1.0, 1.0, 1.1], (1000, 1000, 2800), [0, 0, 0], OPTIONS)
    assert kept.weights == (1000, 1000, 2800)  # balanced already: nothing moves


def test_a_slow_rank_gets_a_share_in_proportion_to_its_speed() -> None:
    verdict = plan([160, 160, 160], [1.0, 1.0, 2.0], None, [0, 0, 0], OPTIONS)
    assert verdict.weights == (1000, 1000, 500)
    assert verdict.speeds == (160.0, 160.0, 80.0)


def test_a_straggler_that_recovers_goes_back_to_an_equal_share() -> None:
    # its small share now takes it far less time than the others' take them
    verdict = plan([192, 192, 96], [1.2, 1.2, 0.6], (1000, 1000, 500), [0, 0, 0], OPTIONS)
    assert verdict.weights is None


def test_a_rank_far_too_slow_is_floored_then_evicted_after_its_windows() -> None:
    slow = [0, 0, 0, 0]
    first = plan([100] * 4, [1.0, 1.0, 1.0, 10.0], None, slow, OPTIONS)  # rank 3: 10x slower
    assert first.weights == (1000, 1000, 1000, 250) and first.evict is None  # floored first
    at_floor = [100, 100, 100, 25]
    assert plan(at_floor, [1.0, 1.0, 1.0, 2.5], first.weights, slow, OPTIONS).evict is None
    assert plan(at_floor, [1.0, 1.0, 1.0, 2.5], first.weights, slow, OPTIONS).evict == 3
    assert plan([100] * 4, [1.0] * 4, None, slow, OPTIONS).evict is None and slow == [0] * 4


def test_a_fixed_overhead_the_share_cannot_shorten_is_floored_not_evicted() -> None:
    """Rank 0 spends 0.01 s a window on its own (store, checkpoints) beside samples that
    cost almost nothing: cutting its share cannot make it as fast as the others. Its
    share falls to the floor and stays there (1.5x the others' time), and it is not
    evicted for it: at the floor it is not twice as slow as the median."""
    slow: list[int] = [0, 0, 0]
    weights: tuple[int, ...] | None = None
    for _ in range(10):
        shares = [1000, 1000, 1000] if weights is None else list(weights)
        samples = [1800 * w / sum(shares) for w in shares]
        seconds = [0.01 + 1e-5 * samples[0], 1e-5 * samples[1], 1e-5 * samples[2]]
        verdict = plan(samples, seconds, weights, slow, OPTIONS)
        weights = verdict.weights
        assert verdict.evict is None
    assert weights == (250, 1000, 1000)


def test_two_ranks_never_evict_one_another() -> None:
    slow = [0, 0]
    for _ in range(5):
        assert plan([100, 25], [1.0, 10.0], (1000, 250), slow, OPTIONS).evict is None


def test_a_window_is_full_after_its_steps_and_none_is_measured_without_times() -> None:
    balancer = Balancer(Stragglers(window=3))
    assert [balancer.record(8, 0.1) for _ in range(3)] == [False, False, True]
    assert not Balancer(Stragglers(window=3)).record(8, None)
    assert not Balancer(Stragglers(window=0)).record(8, 0.1)


@pytest.mark.parametrize("bad", [dict(window=-1), dict(factor=1.0), dict(min_share=0),
                                 dict(evict_factor=-1), dict(evict_windows=0)])
def test_bad_settings_are_one_clear_error(bad: dict) -> None:
    with pytest.raises(ConfigError):
        Stragglers(**bad)
