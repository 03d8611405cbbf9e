"""Step times, the step rate, and the hang watchdog that measures stalls against them."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_rt.harness import wait_until
from elastic_rt.worker.hang import MIN_STALL_S, HangWatchdog, stall_threshold
from elastic_rt.worker.progress import StepClock


def test_rate_and_median_come_from_step_times_not_from_recoveries() -> None:
    clock = StepClock()
    assert clock.median_step_s() is None and clock.steps_per_s() is None
    clock.resume(0.0)
    for t in (0.5, 1.0, 1.5, 2.0):
        clock.completed(t)
    clock.resume(60.0)  # a re-form took a minute: not a step
    clock.completed(60.5)
    assert clock.median_step_s() == pytest.approx(0.5)
    assert clock.steps_per_s() == pytest.approx(2.0)


@pytest.mark.parametrize(("median", "factor", "threshold"), [
    (None, 10.0, None), (0.5, 0.0, None), (0.5, 10.0, 5.0), (0.01, 10.0, MIN_STALL_S),
])
def test_stall_threshold(median: float | None, factor: float, threshold: float | None) -> None:
    assert stall_threshold(median, factor) == threshold


def test_watchdog_reports_a_stall_once_and_rearms_on_the_next_step() -> None:
    clock = StepClock()
    reports: list[tuple[float, float]] = []
    lock = threading.Lock()

    def report(stalled: float, threshold: float) -> None:
        with lock:
            reports.append((stalled, threshold))

    now = time.monotonic()
    clock.resume(now - 0.2)
    clock.completed(now - 0.1)  # median 0.1 s: a stall after max(3 x 0.1, 1 s) = 1 s
    watchdog = HangWatchdog(clock, 3.0, report)
    watchdog.arm()
    try:
        wait_until(lambda: reports, 5.0, "the first stall report")
        stalled, threshold = reports[0]
        assert threshold == MIN_STALL_S and stalled >= threshold
        clock.completed(time.monotonic())  # a step completed: the next stall is a new one
        wait_until(lambda: len(reports) == 2, 5.0, "the second stall report")
        watchdog.disarm()
        clock.completed(time.monotonic())
        time.sleep(1.5)  # past the threshold: disarmed, nothing more may come
        assert len(reports) == 2
    finally:
        watchdog.close()


def test_a_rounds_first_step_is_published_at_once_the_rest_at_most_every_interval() -> None:
    """The leader admits more nodes once the current round has trained (``rounds.decide``):
    the first step of each round must not wait out the interval."""
    from elastic_rt.worker.progress import ProgressPublisher

    class Registry:
        def __init__(self) -> None:
            self.rounds: list[int] = []

        def commit_fenced(self, name: str, value: bytes, token: int) -> None:
            import json

            self.rounds.append(json.loads(value)["round"])

    registry = Registry()
    publisher = ProgressPublisher(registry, every_s=60.0)  # type: ignore[arg-type]
    try:
        clock = StepClock()
        for round_, step in ((1, 1), (1, 2), (2, 3), (2, 4), (3, 5)):
            publisher.publish(step=step, round_=round_, token=1, clock=clock)
            wait_until(lambda: registry.rounds[-1:] == [round_] or step in (2, 4), 5,
                       f"step {step} handed over")
    finally:
        publisher.close()
    assert registry.rounds == [1, 2, 3]
