"""torch's c10d rendezvous of N threads, each trial in a process of its own.

Every node is a thread with a TCPStore client and a DynamicRendezvousHandler over
the c10d backend, counted at its store calls (not counted: the 2 calls per node
that share the bootstrap store address after the round). Past a few hundred nodes
the handlers do not finish, and their threads stay blocked inside the store's C++
calls where no Python code can stop them; so a trial runs in a spawned process that
reports how far it got at its deadline and exits, and the parent kills it (by PID)
if it does not answer. No stuck thread outlives its trial or holds up the next one,
or the benchmark's exit.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from agents.sim.counting import OpCounter

_GRACE_S = 30.0
"""Seconds past its deadline a trial may take to answer before it is killed."""


@dataclass(frozen=True)
class TorchTrial:
    seconds: float
    ops: int
    joined: int
    """Nodes that held the round when the clock stopped (all of them unless it timed out)."""
    answered: bool = True
    """False when the trial process had to be killed: ``joined`` and ``ops`` are unknown."""


class _CountingBackend(C10dRendezvousBackend):
    """torch's c10d backend, counting the store calls it makes."""

    def __init__(self, store: dist.Store, run_id: str, counter: OpCounter) -> None:
        self._counter = counter
        super().__init__(store, run_id)

    def _call_store(self, store_op: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._counter.add(store_op)
        return super()._call_store(store_op, *args, **kwargs)


def torch_c10d_round(n_nodes: int, timeout: float) -> TorchTrial:
    """Time torch's rendezvous of ``n_nodes`` threads in a process of its own."""
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe(duplex=False)
    proc = context.Process(target=_trial, args=(theirs, n_nodes, timeout), daemon=True,
                           name=f"torch-c10d-{n_nodes}")
    began = time.monotonic()
    proc.start()
    theirs.close()
    try:
        if mine.poll(timeout + _GRACE_S):
            trial: TorchTrial = mine.recv()
            return trial
        return TorchTrial(time.monotonic() - began, 0, 0, answered=False)
    except EOFError:  # it died without answering
        return TorchTrial(time.monotonic() - began, 0, 0, answered=False)
    finally:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
        mine.close()


def _trial(conn: Connection, n_nodes: int, timeout: float) -> None:
    """The trial process: one TCPStore server, ``n_nodes`` handler threads, one answer."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    counter = OpCounter()
    handlers = []
    for _ in range(n_nodes):
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
        backend = _CountingBackend(store, run_id, counter)
        handlers.append(
            DynamicRendezvousHandler.from_backend(
                run_id, store, backend, min_nodes=n_nodes, max_nodes=n_nodes,
                local_addr="127.0.0.1", timeout=RendezvousTimeout(join=timedelta(seconds=timeout)),
            )
        )  # fmt: skip
    counter.reset()
    lock, joined, all_in = threading.Lock(), [0], threading.Event()

    def join(handler: DynamicRendezvousHandler) -> None:
        try:
            handler.next_rendezvous()
        except BaseException:  # noqa: BLE001 - thread boundary: a timeout shows in `joined`
            return
        with lock:
            joined[0] += 1
            if joined[0] == n_nodes:
                all_in.set()

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    all_in.wait(timeout)
    seconds = time.monotonic() - began
    with lock:
        conn.send(TorchTrial(seconds, counter.total(), joined[0]))
    conn.close()
    os._exit(0)  # handler threads may still be blocked in the store: do not wait for them
