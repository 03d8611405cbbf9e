"""How fast the job trains: step times, the step rate, and the ``progress`` key.

:class:`StepClock` keeps the completion times of the last steps (pure: the caller
passes the clock): the rate ``elastic-rt status`` shows and the median step time the
hang watchdog (:mod:`elastic_rt.worker.hang`) measures stalls against.
:class:`ProgressPublisher` lets rank 0 write the step and rate to etcd, fenced by its
round's token, at most once a second (one small write whatever the step time), and the
round's layout once per round. :class:`StepReport` is what ``run(on_step=...)`` gets.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

from elastic_rt.errors import FencedOutError, StoreError
from elastic_rt.rendezvous.registry import RunRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepReport:
    """What an ``on_step`` callback receives after every committed step."""

    step: int
    loss: float
    """The mean loss over the whole global batch (all data-parallel ranks)."""
    local_loss: float
    """The mean loss over this rank's samples."""
    world_size: int
    round: int


class StepClock:
    """Completion times of the last ``window`` steps of this worker.

    A re-form is not a step: :meth:`resume` starts timing afresh, so a recovery's
    length never counts as a step time.
    """

    def __init__(self, window: int = 64) -> None:
        self._durations: deque[float] = deque(maxlen=window)
        self.last: float | None = None
        """When the last step completed (or training resumed), monotonic seconds."""

    def resume(self, now: float) -> None:
        self.last = now

    def completed(self, now: float) -> None:
        if self.last is not None:
            self._durations.append(now - self.last)
        self.last = now

    def median_step_s(self) -> float | None:
        return statistics.median(self._durations) if self._durations else None

    def steps_per_s(self) -> float | None:
        if not self._durations:
            return None
        total = sum(self._durations)
        return len(self._durations) / total if total > 0 else None


class ProgressPublisher:
    """Rank 0's step and rate under the run's ``progress`` key, at most every ``every_s``,
    and the round's ``layout``.

    The writes go out from a daemon thread, newest value per key: the training loop only
    hands them over, so a slow or unreachable etcd never delays a step.
    """

    def __init__(self, registry: RunRegistry, every_s: float = 1.0) -> None:
        self.registry = registry
        self.every_s = every_s
        self._published = float("-inf")
        self._round = -1
        self._pending: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._write, name="progress", daemon=True)
        self._thread.start()

    def publish(self, *, step: int, round_: int, token: int, clock: StepClock,
                force: bool = False) -> None:
        """Hand over the step if ``every_s`` passed since the last one, or it is a round's
        first (the leader admits more nodes once the round has trained: ``rounds.decide``),
        or ``force``."""
        now = time.monotonic()
        if not force and now - self._published < self.every_s and round_ == self._round:
            return
        self._published, self._round = now, round_
        rate = clock.steps_per_s()
        value = {"round": round_, "step": step, "ms": int(time.time() * 1000),
                 "steps_per_s": None if rate is None else round(rate, 3)}
        self.commit("progress", json.dumps(value), token)

    def commit(self, name: str, text: str, token: int) -> None:
        """Write ``name`` fenced by ``token``, soon (replacing a value not yet written)."""
        with self._lock:
            self._pending[name] = (text, token)
        self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Write what is pending (for up to ``timeout``), then stop the thread."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)

    def _write(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, {}
            for name, (text, token) in pending.items():
                try:
                    self.registry.commit_fenced(name, text.encode(), token)
                except (FencedOutError, StoreError) as exc:
                    # Status is a report, never a reason to stop training.
                    logger.debug("%s not published: %s", name, exc)
            with self._lock:
                if self._closed and not self._pending:
                    return


def published_step(registry: RunRegistry | None, *, wait_s: float = 30.0) -> int:
    """The newest step the run has published in its ``progress`` key; -1 before the first,
    and outside ``elastic-rt launch`` (no registry). A restore that finds no state reads
    it, so that workers started again never begin the job anew without saying so: a read
    etcd fails (a member restarting) is tried again for up to ``wait_s``, never taken
    for "nothing published".

    Raises:
        StoreError: etcd failed every read for ``wait_s``.
    """
    if registry is None:
        return -1
    deadline = time.monotonic() + wait_s
    while True:
        try:
            progress = registry.progress()
            break
        except StoreError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    step = progress.get("step") if progress else None
    return step if isinstance(step, int) else -1
