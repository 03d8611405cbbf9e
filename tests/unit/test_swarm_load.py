"""The swarm's evidence about itself (agents/sim/swarm.py): when its figures are not etcd's.

A benchmark figure taken while the harness, not etcd, set the pace must be flagged
(scripts/bench/rendezvous.py says so, and takes such a figure as an upper bound).
These check each reason on its own, and the tally a phase waits on (which nodes
hold the wanted round).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from agents.sim.swarm import HarnessLoad, RoundTally
from elastic_rt.rendezvous.rounds import Round


def load(**fields: Any) -> HarnessLoad:
    base: dict[str, Any] = dict(loop_lag=[0.001] * 100, cpu_seconds=1.0, wall_seconds=10.0,
                                box_busy=0.5, box_busy_phase="form")
    base.update(fields)
    return HarnessLoad(**base)


def test_a_quiet_harness_is_not_the_bottleneck() -> None:
    assert load().verdict() is None


def test_a_late_event_loop_makes_the_harness_the_bottleneck() -> None:
    verdict = load(loop_lag=[0.001] * 85 + [0.2] * 15).verdict()
    assert verdict is not None and "event loop p90 lag 200 ms" in verdict


def test_a_process_near_a_full_core_is_gil_bound() -> None:
    verdict = load(cpu_seconds=9.5).verdict()
    assert verdict is not None and "0.95 cores" in verdict


def test_harness_and_etcd_saturating_the_machine_make_it_harness_bound() -> None:
    verdict = load(box_busy=0.93, box_busy_phase="grow 1").verdict()
    assert verdict is not None and "93%" in verdict and "'grow 1'" in verdict


def round_(number: int, *members: str) -> Round:
    return Round(number, members, (1,) * len(members), ("h",) * len(members))


def test_the_tally_counts_each_node_once_with_the_round_it_took() -> None:
    async def scenario() -> None:
        nodes: Any = [SimpleNamespace(node_id="a", rounds=[round_(0, "a", "b")]),
                      SimpleNamespace(node_id="b", rounds=[])]
        tally = RoundTally(nodes, lambda r: r.number >= 0)
        assert tally.pending == {"b"} and not tally.done.is_set()  # a held it already
        tally.saw("b", round_(0, "a", "b"))
        tally.saw("b", round_(1, "b"))  # a later round does not replace the first
        assert tally.done.is_set() and tally.held["b"] == round_(0, "a", "b")
        later = RoundTally(nodes, lambda r: r.number > 0)
        later.saw("a", round_(0, "a"))  # not wanted
        assert later.pending == {"a", "b"}

    asyncio.run(scenario())
