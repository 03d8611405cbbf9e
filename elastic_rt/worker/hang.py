"""The hang report: a rank that completes no step for too long says so, with its stacks.

Each worker runs a watchdog thread while it trains. When no step has completed for
``factor`` times the median step time (and at least ``MIN_STALL_S``), it logs one
line naming its global rank and node, emits ``step.stalled``, and dumps every
thread's Python stack into its log with :mod:`faulthandler` (no py-spy needed). Every
rank of a stalled job reports: the one stuck in user code shows where; the others
show the collective they wait in. One report per stall; the next completed step
re-arms it. Not armed while a round re-forms (no step is expected then).

Note: the thread needs the GIL; a rank stuck in C code that holds it reports nothing.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from typing import Callable

from elastic_rt.config import WorkerEnv
from elastic_rt.events import EventSink
from elastic_rt.worker.progress import StepClock

logger = logging.getLogger(__name__)

MIN_STALL_S = 1.0
"""Below this, a pause (a GC, a checkpoint's staging) is not worth a report."""


def stall_threshold(median_step_s: float | None, factor: float) -> float | None:
    """Seconds without a step that make a stall; None while no step time is known."""
    if median_step_s is None or factor <= 0:
        return None
    return max(factor * median_step_s, MIN_STALL_S)


class HangWatchdog:
    """Watches a :class:`StepClock` from a daemon thread; ``report`` is called once per stall.

    Args:
        clock: the training loop's step clock (its ``last`` is read, never written).
        factor: stall = ``factor`` x the median step time; 0 turns the watchdog off.
        report: called with (seconds stalled, threshold) from the watchdog thread.
    """

    def __init__(self, clock: StepClock, factor: float,
                 report: Callable[[float, float], None]) -> None:
        self.clock, self.factor, self.report = clock, factor, report
        self._armed = False
        self._reported_for: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """Training (re)started: stalls count from the clock's last step."""
        self._armed = True
        if self._thread is None and self.factor > 0:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        self._armed = False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            last = self.clock.last
            threshold = stall_threshold(self.clock.median_step_s(), self.factor)
            if not self._armed or last is None or threshold is None:
                continue
            stalled = time.monotonic() - last
            if stalled >= threshold and self._reported_for != last:
                self._reported_for = last
                self.report(stalled, threshold)


def dump_stacks() -> None:
    """Every thread's Python stack to stderr (the worker's log), as faulthandler prints it."""
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


def report_stall(stalled_s: float, threshold_s: float, *, events: EventSink, env: WorkerEnv,
                 rank: int, round_: int | None, step: int) -> None:
    """Name this rank (a log line and ``step.stalled``), then dump its stacks into the log."""
    logger.error("hang: rank %d on %s completed no step for %.1f s (over %.1f s, %g x the "
                 "median step time); its Python stacks follow", rank, env.node_id,
                 stalled_s, threshold_s, env.hang_factor)
    events.emit("step.stalled", round=round_, step=step, stalled_s=round(stalled_s, 1),
                threshold_s=round(threshold_s, 2))
    dump_stacks()
