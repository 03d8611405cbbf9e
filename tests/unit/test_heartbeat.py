"""Heartbeats' pure rules: who watches whom, and when silence evicts."""

from __future__ import annotations

from datetime import timedelta

import pytest

from agents.alive import Liveness
from agents.heartbeat import after_probe, probe_timeout, watched_peer
from elastic_rt.config import HeartbeatConfig
from elastic_rt.errors import ConfigError
from elastic_rt.rendezvous.rounds import Round

CONFIG = HeartbeatConfig(interval=timedelta(seconds=0.1), misses=4)


def _round(*members: str, number: int = 1) -> Round:
    return Round(number=number, members=members, nprocs=(1,) * len(members),
                 hosts=("127.0.0.1",) * len(members))


def test_every_member_is_watched_by_exactly_one_other_in_rank_order() -> None:
    members = tuple(f"n{i}" for i in range(1024))
    round_ = _round(*members)
    watched = [watched_peer(round_, m) or "" for m in members]
    assert sorted(watched) == sorted(members)  # a ring: N probes per interval, not N^2
    assert watched_peer(round_, "n0") == "n1" and watched_peer(round_, "n1023") == "n0"


@pytest.mark.parametrize("round_, me", [
    (None, "a"),
    (_round("a"), "a"),
    (_round("a", "b"), "c"),
    (_round("a", "b", number=-1), "a"),  # standby: in no round yet
])
def test_nobody_is_watched_outside_a_round_of_two_or_more(round_, me) -> None:
    assert watched_peer(round_, me) is None


def test_a_late_answer_still_counts_and_resets_the_silence() -> None:
    beat = after_probe(Liveness.ALIVE, now=10.0, last_answer=9.0, config=CONFIG)
    assert not beat.should_evict and beat.last_answer == 10.0


def test_silence_evicts_only_once_the_whole_window_has_passed() -> None:
    early = after_probe(Liveness.UNKNOWN, now=10.39, last_answer=10.0, config=CONFIG)
    assert not early.should_evict
    assert after_probe(Liveness.UNKNOWN, now=10.4, last_answer=10.0, config=CONFIG).should_evict


def test_a_refused_port_evicts_at_once() -> None:
    assert after_probe(Liveness.DEAD, now=10.01, last_answer=10.0, config=CONFIG).should_evict


def test_a_probe_waits_for_the_rest_of_the_window_but_at_least_an_interval() -> None:
    assert probe_timeout(now=10.1, last_answer=10.0, config=CONFIG) == pytest.approx(0.3)
    assert probe_timeout(now=12.0, last_answer=10.0, config=CONFIG) == pytest.approx(0.1)


def test_heartbeat_settings_come_from_the_environment() -> None:
    env = {"ELASTIC_RT_HEARTBEAT_INTERVAL_SEC": "0.25", "ELASTIC_RT_HEARTBEAT_MISSES": "6"}
    config = HeartbeatConfig.from_env(env)
    assert config.interval == timedelta(seconds=0.25) and config.misses == 6
    assert config.window_s == pytest.approx(1.5)
    assert HeartbeatConfig.from_env({}) == HeartbeatConfig()
    assert HeartbeatConfig.from_env({"ELASTIC_RT_HEARTBEAT_INTERVAL_SEC": "0"}).interval_s == 0


@pytest.mark.parametrize("misses", ["0", "2.5", "many"])
def test_a_bad_miss_count_is_one_clear_error(misses: str) -> None:
    with pytest.raises(ConfigError, match="ELASTIC_RT_HEARTBEAT_MISSES"):
        HeartbeatConfig.from_env({"ELASTIC_RT_HEARTBEAT_MISSES": misses})


def test_a_watcher_cut_off_itself_during_the_silence_starts_a_fresh_window() -> None:
    """Its own lease failed to renew after the peer's last answer: the silence may be its
    own isolation, so the peer is not blamed (a link that came back evicted a healthy one)."""
    own = after_probe(Liveness.UNKNOWN, now=14.0, last_answer=10.0, config=CONFIG,
                      cut_off_since=12.0)
    assert not own.should_evict and own.last_answer == 14.0
    earlier = after_probe(Liveness.UNKNOWN, now=14.0, last_answer=10.0, config=CONFIG,
                          cut_off_since=9.0)  # a failure before the silence says nothing
    assert earlier.should_evict
    assert after_probe(Liveness.DEAD, now=14.0, last_answer=10.0, config=CONFIG,
                       cut_off_since=12.0).should_evict  # a refused port is the peer's
