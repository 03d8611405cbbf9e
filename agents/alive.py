"""A node's liveness socket, and the probe that tells "dead" from "maybe slow".

A survivor whose collective just failed wants to know *now* whether a peer is
gone, without waiting out its lease. A SIGKILLed agent's port refuses connections
at once; a live agent answers ``ok``. A hung (SIGSTOPped) agent's kernel still
accepts the connection but nobody answers: that is "unknown", and the lease TTL
decides. So a live node that still answers is never evicted.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading

from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import Round

logger = logging.getLogger(__name__)


class Liveness(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class AliveServer:
    """Answers ``ok`` to every connection, from a daemon thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="alive-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(b"ok")
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def probe(address: str, timeout: float = 0.5) -> Liveness:
    """Ask the agent at ``host:port`` whether it lives."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return Liveness.ALIVE if conn.recv(2) == b"ok" else Liveness.DEAD
    except ConnectionRefusedError:
        return Liveness.DEAD
    except (TimeoutError, socket.timeout):
        return Liveness.UNKNOWN
    except OSError:
        return Liveness.UNKNOWN


def probe_members(registry: RunRegistry, round_: Round, me: str) -> tuple[list[str], list[str]]:
    """Probe every other member of ``round_``; evict those whose agent is certainly gone.

    Returns (dead members, members that did not answer in time).
    """
    registered = registry.nodes()
    dead, unsure = [], []
    for member in round_.members:
        if member == me:
            continue
        info = registered.get(member)
        if info is None:
            dead.append(member)
            continue
        liveness = probe(info.alive_addr) if info.alive_addr else Liveness.UNKNOWN
        if liveness is Liveness.DEAD:
            registry.evict(info)
            dead.append(member)
        elif liveness is Liveness.UNKNOWN:
            unsure.append(member)
    if dead:
        logger.warning("peers gone: %s", ",".join(dead))
    return dead, unsure
