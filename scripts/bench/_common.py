"""Shared pieces of the process benchmarks: interruption, JSON-lines tails, tables, loopback.

Every process a benchmark starts goes through an :class:`elastic_rt.harness.ProcessLedger`,
which starts it in its own session and, on close (also on Ctrl-C or SIGTERM, see
:func:`interruptible`), kills every process group it started and every descendant
it has seen, so no agent, worker or etcd outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import math
import signal
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

from elastic_rt.events import JsonLinesTail


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt, so ``finally`` blocks clean up on both."""

    def on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class JsonLines(JsonLinesTail):
    """A :class:`~elastic_rt.events.JsonLinesTail` that also keeps every row it read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.rows: list[dict] = []

    def poll(self) -> list[dict]:
        new = super().poll()
        self.rows.extend(new)
        return new


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def p90(values: Sequence[float]) -> float | None:
    """The 90th percentile (nearest rank): with 10 values, the second largest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width text table."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line("-" * w for w in widths), *(line(r) for r in rows)])


def loopback_rate(nbytes: int = 1 << 30, chunk: int = 16 << 20, tries: int = 3) -> float:
    """Bytes a second one TCP connection on 127.0.0.1 carries (a thread each side, the
    kernel copying between them, as a stream between two ranks' processes does): the best
    of ``tries``, the machine's speed rather than its load at one moment (one try on this
    shared machine read 1.5-4.8 GB/s), so that a ratio to it is not flattered by a slow try."""
    return max(_loopback_once(nbytes, chunk) for _ in range(tries))


def _loopback_once(nbytes: int, chunk: int) -> float:
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = threading.Thread(target=_send_zeros,
                                  args=(server.getsockname(), nbytes, chunk), daemon=True)
        began = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        with conn:
            buffer, left = memoryview(bytearray(chunk)), nbytes
            while left:
                left -= conn.recv_into(buffer, min(chunk, left))
        elapsed = time.perf_counter() - began
        sender.join()
    return nbytes / elapsed


def receive_once(nbytes: int = 1 << 30, chunk: int = 16 << 20) -> None:
    """One side of a two-process :func:`loopback_rate`: listen, print the port, take
    ``nbytes`` from the first connection and print its rate (from the accept on), for a
    caller that holds each side to a node's CPU share."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        began = time.perf_counter()
        with conn:
            buffer, left = memoryview(bytearray(chunk)), nbytes
            while left:
                left -= conn.recv_into(buffer, min(chunk, left))
        print(nbytes / (time.perf_counter() - began), flush=True)


def send_once(port: int, nbytes: int = 1 << 30, chunk: int = 16 << 20) -> None:
    """The other side of :func:`receive_once`: once a line on stdin says go (its caller
    has moved it into its CPU share by then), send ``nbytes`` of zeros to ``port``."""
    import sys
    sys.stdin.readline()
    _send_zeros(("127.0.0.1", port), nbytes, chunk)


def _send_zeros(address: tuple[str, int], nbytes: int, chunk: int) -> None:
    block = memoryview(bytes(chunk))  # a view: a short last slice of bytes would be a copy
    with socket.create_connection(address) as conn:
        for start in range(0, nbytes, chunk):
            conn.sendall(block[:min(chunk, nbytes - start)])
