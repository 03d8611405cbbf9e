"""This node's workers as the agent knows them: started with their environment, watched
with their acknowledgements and error files, stopped.

The processes themselves are :class:`~agents.processes.WorkerGroup`'s; this adds what
the agent knows about them: the environment each one gets (one
:class:`~elastic_rt.config.WorkerEnv` path, see :mod:`agents.worker_env`), the
directory their in-process acknowledgements land in, and the events that say so.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Callable, Sequence

from agents.config import AgentConfig
from agents.policy import acks_in_process
from agents.processes import WorkerGroup
from agents.worker_env import process_env, round_envs, standby_envs
from agents.worker_state import WorkerExit, WorkerState
from elastic_rt.acks import read_acks, read_left, write_leave_note
from elastic_rt.childproc import owned_temp_dir
from elastic_rt.config import WorkerEnv
from elastic_rt.events import EventSink
from elastic_rt.rendezvous.rounds import Round
from elastic_rt.root_cause import ErrorRecord, RootCause, read_error_file

logger = logging.getLogger(__name__)


class LocalWorkers:
    def __init__(self, config: AgentConfig, events: EventSink) -> None:
        self.command = config.command
        self.nproc = config.nproc_per_node
        self.events = events
        self.agent_dir = owned_temp_dir("elastic-rt-agent-")
        self.group = WorkerGroup(
            config.grace_period.total_seconds(), output=config.output, log_dir=self.agent_dir
        )
        rdzv = config.rendezvous
        self._shared = WorkerEnv(
            node_id=config.node_id, node_host=config.host, run_id=rdzv.run_id,
            endpoint=rdzv.endpoint,
            agent_dir=self.agent_dir, events_file=config.events_file, lease_ttl=rdzv.lease_ttl,
            auth=rdzv.auth, max_restarts=config.max_restarts, hang_factor=config.hang_factor,
            max_nodes=rdzv.max_nodes,
        )  # fmt: skip
        """What every local worker's environment shares, whatever the round."""

    def start_in(self, round_: Round, master: tuple[str, int], *, first: bool) -> None:
        """Start the workers in ``round_``; ``restart_count`` is the job's failure count
        (``round_.restarts``), and a start that is not this node's first is a restart."""
        envs = round_envs(self._shared, round_, master=master, restart_count=round_.restarts)
        pids = self._start(envs)
        self.events.emit(
            "worker.started" if first else "worker.restarted", round=round_.number,
            pids=pids, world_size=round_.world_size, restart_count=round_.restarts,
        )  # fmt: skip

    def start_standby(self, restart_count: int, *, first: bool) -> None:
        """Start workers outside any round (see :meth:`Agent._start_in_standby`)."""
        pids = self._start(standby_envs(self._shared, self.nproc, restart_count=restart_count))
        self.events.emit("worker.started" if first else "worker.restarted", pids=pids,
                         restart_count=restart_count, standby=True)

    def wait_announced(self, seconds: float, give_up: Callable[[], bool],
                       sleep: Callable[[float], None]) -> bool:
        """Wait until every worker announced in-process recovery; False if not in time."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not give_up():
            if self.poll()[0] is not WorkerState.RUNNING or self.in_process():
                break
            sleep(0.1)
        return self.in_process()

    def report_failed(self, round_: Round, exits: tuple[WorkerExit, ...]) -> WorkerExit:
        """Say which workers failed in ``round_``; returns the first of them."""
        failed = [e for e in exits if e.exitcode != 0]
        for e in failed:
            self.events.emit("worker.failed", round=round_.number, local_rank=e.local_rank,
                             pid=e.pid, exitcode=e.exitcode)
        return failed[0]

    def root_cause(self, round_: Round, exits: Sequence[WorkerExit], host: str,
                   step: int | None) -> RootCause:
        """The failure to report: the earliest failed worker that left an error file, else
        the first failed one (``step``: the job's last step, if the file has none)."""
        records = self._records([e for e in exits if e.exitcode != 0])
        recorded = [(r, e) for r, e in records if r is not None]
        return self._cause(round_, *(min(recorded, key=lambda p: p[0].time_s or 0)
                                     if recorded else records[0]), host=host, step=step)

    def raised(self, round_: Round, exits: Sequence[WorkerExit], host: str) -> RootCause | None:
        """The cause a worker among ``exits`` left in its error file; None if none did."""
        recorded = [(r, e) for r, e in self._records(exits) if r is not None]
        if not recorded:
            return None
        return self._cause(round_, *min(recorded, key=lambda p: p[0].time_s or 0), host=host,
                           step=None)

    def _records(self, exits: Sequence[WorkerExit]
                 ) -> list[tuple[ErrorRecord | None, WorkerExit]]:
        files = self.group.error_files
        return [(read_error_file(files[e.local_rank]) if e.local_rank < len(files) else None, e)
                for e in exits]

    def _cause(self, round_: Round, record: ErrorRecord | None, exit_: WorkerExit, *,
               host: str, step: int | None) -> RootCause:
        node = self._shared.node_id
        base = round_.rank_offset(node) if node in round_.members else 0
        return RootCause(
            round=round_.number, rank=base + exit_.local_rank, node=node, host=host,
            time_ms=(record.time_s * 1000 if record and record.time_s
                     else int(time.time() * 1000)),
            exitcode=exit_.exitcode, error=record.error if record else "",
            traceback=record.traceback if record else "",
            step=record.step if record and record.step is not None else step,
        )  # fmt: skip

    def poll(self) -> tuple[WorkerState, list[WorkerExit]]:
        return self.group.poll()

    def acks(self) -> tuple[int | None, ...]:
        return read_acks(self.agent_dir, self.group.pids)

    def left(self) -> tuple[int | None, ...]:
        """Per worker: the step after which it left at a boundary (its node leaving), or None."""
        return read_left(self.agent_dir, self.group.pids)

    def tell_to_leave(self, source: str) -> None:
        """The workers leave after their next step, every rank at the same one."""
        write_leave_note(self.agent_dir, source)

    def in_process(self) -> bool:
        return acks_in_process(self.acks())

    def stop(self, why: str = "", *, grace: bool = True) -> list[WorkerExit]:
        """Stop every worker (thread-safe: the lease thread calls it when fencing);
        returns how each one ended. ``grace=False``: SIGKILL at once."""
        if why and self.group.pids:
            logger.info("stopping workers: %s", why)
        return self.group.stop(grace=grace)

    def close(self) -> None:
        self.group.stop()
        shutil.rmtree(self.agent_dir, ignore_errors=True)

    def _start(self, envs: list[WorkerEnv]) -> list[int]:
        return self.group.start(self.command, [process_env(os.environ, e) for e in envs])
