"""The worker's view of rounds: follow them, host or find the round's store, report.

In-process recovery needs each worker to learn about a new round without being
restarted. A worker keeps its own etcd client and a watch on the run's keys, so
``has_newer_round()`` is an in-memory check it can afford at every step boundary.
It never writes rounds itself: agents decide membership; a worker only raises the
alarm when a collective fails, acknowledges the round it has joined (a file its
agent reads, ``elastic_rt.acks``), and commits fenced values.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Protocol, runtime_checkable

from elastic_rt.acks import leave_note, write_ack, write_left
from elastic_rt.config import WorkerEnv
from elastic_rt.errors import RendezvousClosedError, RendezvousTimeoutError, StoreError
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import Round

logger = logging.getLogger(__name__)


class RoundFollower:
    """Follows the run's rounds from inside a worker.

    Args:
        env: the worker's environment as set by the agent.
        on_round: called from the watch thread with each round read after a change
            (the loop's abort notice, ``worker/abort.py``); must not block.
    """

    def __init__(self, env: WorkerEnv, on_round: Callable[[Round], None] | None = None) -> None:
        self.env = env
        self._on_round = on_round
        self.kv = EtcdKV(env.endpoint, auth=env.auth)
        self.registry = RunRegistry(self.kv, env.run_id)
        self._changed = threading.Event()
        self._newest = env.round
        self._lock = threading.Lock()
        self._cancel = self.kv.on_change(self.registry.key("round"), self._on_round_change)

    def _on_round_change(self) -> None:
        try:
            current = self.registry.current_round()
        except StoreError:
            return
        if current is not None:
            with self._lock:
                self._newest = max(self._newest, current.number)
            if self._on_round is not None:
                self._on_round(current)
        self._changed.set()

    def has_newer_round(self, than: int) -> bool:
        """Cheap: answered from the watch, no round trip."""
        with self._lock:
            return self._newest > than

    def current(self) -> Round:
        """The round the agent started us in; for a worker started outside any round
        (``ELASTIC_RT_ROUND=-1``: a newcomer, a replacement, a spare), the first round
        that gives this worker a rank, however long that takes: a spare waits until a
        member is lost. It dies with its agent, and ends when the run closes.

        Raises:
            RendezvousClosedError: the run closed before a round gave us a rank.
            RendezvousTimeoutError: the round the agent started us in is not in etcd.
        """
        deadline = time.monotonic() + 120
        while self.env.round < 0 or time.monotonic() < deadline:
            self._changed.clear()  # set by the watch when a round key changes: read again
            current = self._read_round()
            if current is not None and current.number >= self.env.round and self._in(current):
                return current
            if self.env.round < 0 and (closed := self._read_closed()) is not None:
                raise RendezvousClosedError(f"the job was closed before this worker had a "
                                            f"rank: {closed}")
            self._changed.wait(5.0 if self.env.round < 0 else 0.2)  # a spare may wait hours
        raise RendezvousTimeoutError(f"round {self.env.round} not found in etcd",
                                     "Restart the job.")

    def wait_for_round(self, after: int, timeout: timedelta) -> Round:
        """Block until a round newer than ``after`` that includes this node exists.

        Raises:
            RendezvousClosedError: the job was closed meanwhile.
            RendezvousTimeoutError: no such round within ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            self._changed.clear()
            try:
                closed = self.registry.closed_reason()
                if closed is not None:
                    raise RendezvousClosedError(f"the job was closed: {closed}")
                current = self.registry.current_round()
            except StoreError as exc:
                logger.warning("etcd unavailable while waiting for a round: %s", exc)
                current = None
            if current and current.number > after and self._in(current):
                return current
            self._changed.wait(0.2)
        raise RendezvousTimeoutError(
            f"no new round including {self.env.node_id} within {timeout.total_seconds():.0f} s",
            "Check that the agents are alive and can reach etcd.",
        )

    def rank_in(self, round_: Round) -> int:
        """This worker's global rank in ``round_`` (a round that includes it)."""
        return round_.rank_offset(self.env.node_id) + self.env.local_rank

    def _in(self, round_: Round) -> bool:
        """``round_`` gives this worker a rank. A node whose workers are being replaced
        stays a member with fewer ranks (none); its replacements wait for the round
        that gives theirs back."""
        if self.env.node_id not in round_.members:
            return False
        return self.env.local_rank < round_.nprocs[round_.group_rank(self.env.node_id)]

    def store_address(self, round_: Round, timeout: timedelta) -> tuple[str, int] | None:
        """The ``host:port`` its first node's agent published for the round's store.

        None when a newer round formed first: the first node died before publishing.

        Raises:
            RendezvousTimeoutError: neither within ``timeout``.
        """
        return self.registry.await_store(
            round_.number, timeout, gone=lambda: self.has_newer_round(round_.number),
            sleep=time.sleep, poll=0.01,
        )  # fmt: skip

    def _read_round(self) -> Round | None:
        """The run's round; None also while etcd fails the read (the caller polls): a
        cluster member that restarts fails the call in flight, and raised, it ended the
        worker before it joined its first round."""
        try:
            return self.registry.current_round()
        except StoreError as exc:
            logger.warning("etcd failed a read of the round: %s", exc)
            return None

    def _read_closed(self) -> str | None:
        """Why the run closed, if it did; None also while etcd fails the read."""
        try:
            return self.registry.closed_reason()
        except StoreError as exc:
            logger.warning("etcd failed a read of the run's state: %s", exc)
            return None

    def report_failure(self, round_: Round) -> None:
        """Ask the agents to check on our peers, unless a newer round already exists."""
        try:
            current = self.registry.current_round()
            if current is not None and current.number == round_.number:
                self.registry.raise_alarm(round_.number, self.env.node_id)
        except StoreError as exc:
            logger.warning("could not raise the alarm: %s", exc)

    def evict(self, node_id: str) -> bool:
        """Revoke ``node_id``'s lease, as its agents' heartbeats do to a hung node: the
        agents form a round without it, and its agent finds itself fenced and comes
        back through standby. Whether it was registered (and so evicted now).

        Raises:
            StoreError: etcd did not answer.
        """
        info = self.registry.node(node_id)
        if info is None:
            return False
        self.registry.evict(info)
        logger.warning("evicted %s: its workers stayed too slow", node_id)
        return True

    def announce(self) -> None:
        """Tell the agent we run in-process before we have joined any round."""
        self._write_ack(-1)

    def acknowledge(self, round_: Round) -> None:
        """Tell the agent we run in-process and have joined ``round_``."""
        self._write_ack(round_.number)

    def leave_note(self) -> str | None:
        """What asked this node to leave, once its agent said so (a ``stat`` per call)."""
        return leave_note(self.env.agent_dir) if self.env.agent_dir else None

    def left(self, step: int) -> None:
        """Tell the agent this worker left after ``step``, its state handed over."""
        if self.env.agent_dir:
            write_left(self.env.agent_dir, self.env.local_rank, step)

    def _write_ack(self, round_number: int) -> None:
        if self.env.agent_dir:
            write_ack(self.env.agent_dir, self.env.local_rank, round_number)

    def close(self) -> None:
        self._cancel()
        self.kv.close()


@runtime_checkable
class Membership(Protocol):
    """Where the elastic loop's rounds come from: what it asks of a :class:`RoundFollower`.

    The loop calls nothing else, so a job outside ``elastic-rt launch`` runs the same
    loop with a fixed membership (``worker/static_membership.py``).
    """

    @property
    def registry(self) -> RunRegistry | None:
        """The run's keys in etcd; None where there are none (no agents, no etcd)."""
        ...

    def current(self) -> Round: ...

    def has_newer_round(self, than: int) -> bool: ...

    def wait_for_round(self, after: int, timeout: timedelta) -> Round: ...

    def rank_in(self, round_: Round) -> int: ...

    def store_address(self, round_: Round, timeout: timedelta) -> tuple[str, int] | None: ...

    def report_failure(self, round_: Round) -> None: ...

    def evict(self, node_id: str) -> bool: ...

    def announce(self) -> None: ...

    def acknowledge(self, round_: Round) -> None: ...

    def leave_note(self) -> str | None:
        """What asked this worker's node to leave (its agent's note), or None."""
        ...

    def left(self, step: int) -> None:
        """This worker left after ``step`` (its node leaves); nothing follows."""
        ...

    def close(self) -> None: ...
