"""A replica stream's bytes over plain TCP: one connection from each receiver to each holder
that sends it anything, the plan's chunks (``replica_transfer.chunks`` and ``senders``) in
order on each, read by ``recv_into`` straight into the receiver's tensors.

Why not the group's backend: the stream alone (``scripts/bench/stream.py --state-mb 1200``:
two holders, one receiver, nothing else running, both ways in one run) moves 1.2 GB at
4.7-5.3 GB/s here, 1.0-1.3 times one loopback TCP connection measured beside it, and
3.0-3.9 GB/s (0.67-0.85) through gloo. Beside the holders' training (``scripts/bench/
recovery.py --cases inproc-join --state-mb 1200``, 2 cores shared by three training workers)
it is the CPU that limits: 1.9-2.7 GB/s, 0.39-0.57 of loopback (1.16-1.90 GB/s through gloo
in an earlier run). So host tensors go over sockets of our own; a
device's go through the backend (NCCL moves them device to device), and so does every
stream where a rank has no IPv4 address to offer.

Rules:
- Addresses: each holder listens on an ephemeral port of its node's address (its agent's,
  else the one its gloo uses: :func:`own_address`), and one all-gather of the group
  tells every rank every holder's address, port and a random nonce. A receiver opens with
  the nonce: a connection from another stream, or a stranger, is dropped.
- Giving up (the round is gone) shuts every socket down and joins every thread, so no
  byte lands in a tensor once :meth:`Links.close` has returned: the next round's restore
  owns the memory (gloo's receives could still land; ``replica_transfer._Wires``).
- A peer that dies ends its connection (a reset, or end of file): the transfer raises
  ``RuntimeError`` naming it; a hung peer holds its thread until the round's notice makes
  the owner close the links.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
from collections import Counter
from typing import Callable

import psutil
import torch
import torch.distributed as dist

from elastic_rt.config import NODE_HOST_ENV, STREAM_OVER_TCP_ENV
from elastic_rt.worker import abort

CONNECT_S = 10.0
"""Seconds a receiver tries to reach a holder (it listens before the addresses go out)."""
_ATTEMPT_S = 0.5
"""One connection attempt: what a close waits at most for a receiver still connecting."""
_HEADER = struct.Struct("<q")
"""A receiver's first bytes: the holder's nonce."""

Piece = tuple[int, int, int]
"""(tensor index, first byte, end byte), as ``replica_transfer.chunks`` makes them."""


def own_address() -> str | None:
    """The IPv4 address other ranks reach this one at: its agent's (the node's address in
    the rendezvous, ``ELASTIC_RT_NODE_HOST``), else ``GLOO_SOCKET_IFNAME``'s, else the host
    name's (as gloo finds its own); None when there is none."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    host = os.environ.get(NODE_HOST_ENV, "")
    if not host and interface:
        found = [a.address for a in psutil.net_if_addrs().get(interface, [])
                 if a.family == socket.AF_INET]
        return found[0] if found else None
    try:
        return socket.gethostbyname(host or socket.gethostname())
    except OSError:
        return None


class Links:
    """This rank's connections for one stream. Made by :func:`open_links` on every rank."""

    def __init__(self, me: int, listener: socket.socket | None, nonce: int,
                 holders: dict[int, tuple[str, int, int]]) -> None:
        self.me, self.listener, self.nonce, self.holders = me, listener, nonce, holders
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = [] if listener is None else [listener]
        self._threads: list[threading.Thread] = []
        self._closed = False

    def transfer(self, pieces: list[Piece], senders: list[int], receivers: tuple[int, ...],
                 bytes_of: Callable[[int], torch.Tensor],
                 on_received: Callable[[int], Callable[[], None] | None]) -> int:
        """Send this holder's pieces to every receiver, or receive this receiver's pieces
        from every holder; the bytes sent or received. Blocks until done.

        ``bytes_of(index)`` gives tensor ``index``'s bytes (a flat uint8 view),
        ``on_received(index)`` what to run once all of its pieces arrived.

        Raises:
            RuntimeError: a peer's connection failed, or the links were closed.
        """
        errors: list[BaseException] = []
        if self.me in receivers:
            remaining = Counter(index for index, _, _ in pieces)
            by_holder: dict[int, list[Piece]] = {}
            for piece, sender in zip(pieces, senders):
                by_holder.setdefault(sender, []).append(piece)
            arrived = threading.Lock()

            def landed(index: int) -> None:
                with arrived:
                    remaining[index] -= 1
                    then = on_received(index) if remaining[index] == 0 else None
                if then is not None:
                    then()
            for holder, mine in by_holder.items():
                self._start(errors, self._receive, holder, mine, bytes_of, landed)
            moved = sum(end - start for _, start, end in pieces)
        else:
            mine = [piece for piece, sender in zip(pieces, senders) if sender == self.me]
            if mine:
                for conn in self._accept(len(receivers)):
                    self._start(errors, self._send, conn, mine, bytes_of)
            moved = sum(end - start for _, start, end in mine) * len(receivers)
        for thread in list(self._threads):
            thread.join()
        if errors:
            raise errors[0]
        if self._closed:
            raise RuntimeError("the state stream was given up (its round is gone)")
        return moved

    def _start(self, errors: list[BaseException], target: Callable[..., None],
               *args: object) -> None:
        def run() -> None:
            try:
                target(*args)
            except BaseException as exc:  # a thread boundary: transfer() raises the first
                errors.append(exc)
                self._shut_down()  # the others stop too: the stream failed
        thread = threading.Thread(target=run, name="replica-tcp", daemon=True)
        with self._lock:
            if self._closed:
                raise RuntimeError("the state stream was given up (its round is gone)")
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            if self._closed:
                sock.close()
                raise RuntimeError("the state stream was given up (its round is gone)")
            self._sockets.append(sock)
        return sock

    def _accept(self, count: int) -> list[socket.socket]:
        """``count`` receivers' connections that open with this stream's nonce."""
        assert self.listener is not None
        accepted: list[socket.socket] = []
        while len(accepted) < count:
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                raise RuntimeError(f"the state stream's listener closed: {exc}") from exc
            conn = self._track(conn)
            conn.settimeout(CONNECT_S)
            try:
                (nonce,) = _HEADER.unpack(_read_exactly(conn, _HEADER.size))
            except (OSError, RuntimeError):
                conn.close()
                continue
            if nonce != self.nonce:
                conn.close()  # another stream's, or a stranger
                continue
            conn.settimeout(None)
            accepted.append(conn)
        return accepted

    def _connect(self, holder: int, host: str, port: int) -> socket.socket:
        """A connection to ``holder``, tried in short attempts (a close in between stops
        it) for ``CONNECT_S``; a refusal ends it at once (the holder is gone)."""
        deadline = time.monotonic() + CONNECT_S
        while True:
            if self._closed:
                raise RuntimeError("the state stream was given up (its round is gone)")
            try:
                conn = socket.create_connection((host, port), timeout=_ATTEMPT_S)
            except socket.timeout as exc:
                if time.monotonic() < deadline:
                    continue
                raise RuntimeError(f"Socket Timeout: rank {holder}'s state stream at "
                                   f"{host}:{port} did not answer") from exc
            except OSError as exc:
                raise RuntimeError(f"Connection refused: rank {holder}'s state stream at "
                                   f"{host}:{port} ({exc})") from exc
            conn = self._track(conn)
            conn.settimeout(None)
            return conn

    def _send(self, conn: socket.socket, pieces: list[Piece],
              bytes_of: Callable[[int], torch.Tensor]) -> None:
        for index, start, end in pieces:
            piece = bytes_of(index)[start:end]
            try:
                conn.sendall(piece.numpy().data)
            except OSError as exc:
                raise RuntimeError(f"Connection reset by peer: the state stream to a "
                                   f"receiver broke off ({exc})") from exc

    def _receive(self, holder: int, pieces: list[Piece],
                 bytes_of: Callable[[int], torch.Tensor],
                 landed: Callable[[int], None]) -> None:
        host, port, nonce = self.holders[holder]
        conn = self._connect(holder, host, port)
        try:
            conn.sendall(_HEADER.pack(nonce))
            for index, start, end in pieces:
                view = bytes_of(index)[start:end].numpy().data
                while view:
                    got = conn.recv_into(view)
                    if got == 0:
                        raise RuntimeError(f"Connection closed by peer: rank {holder}'s "
                                           "state stream ended early")
                    view = view[got:]
                landed(index)
        except OSError as exc:
            raise RuntimeError(f"Connection reset by peer: rank {holder}'s state stream "
                               f"broke off ({exc})") from exc

    def _shut_down(self) -> None:
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected (a listener), or already down

    def close(self) -> None:
        """Stop: every socket shut down and closed, every thread joined (no byte lands
        after this returns). Idempotent."""
        with self._lock:
            self._closed = True
        self._shut_down()
        with self._lock:
            threads, sockets = list(self._threads), list(self._sockets)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()
        for sock in sockets:
            sock.close()


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise RuntimeError("Connection closed by peer before its header")
        data += more
    return data


def open_links(*, host_only: bool, is_holder: bool, group: dist.ProcessGroup) -> Links | None:
    """Listen (a holder), then tell every rank of ``group`` every holder's address: the
    links of one stream, or None when a rank cannot use them (a tensor on a device, no
    IPv4 address, ``ELASTIC_RT_STREAM_OVER_TCP=0``), and the stream goes through the
    group's backend. Collective.

    Raises:
        RoundAbandoned: a newer round dropped a member while this waited.
        RuntimeError: a peer's connection failed.
    """
    address = own_address() if host_only and os.environ.get(STREAM_OVER_TCP_ENV) != "0" \
        else None
    listener: socket.socket | None = None
    port = 0
    if address is not None and is_holder:
        try:
            listener = socket.create_server((address, 0))
            port = listener.getsockname()[1]
        except OSError:  # the name resolves to an address this host does not have
            address = None
    nonce = secrets.randbits(62)
    ip = int(ipaddress.IPv4Address(address)) if address is not None else -1
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    mine = torch.tensor([ip, port, nonce], dtype=torch.int64)
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    assert work is not None  # async_op=True always returns a Work
    try:
        abort.wait(work.get_future())
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if any(int(row[0]) < 0 for row in gathered):
        if listener is not None:
            listener.close()
        return None
    holders = {rank: (str(ipaddress.IPv4Address(int(row[0]))), int(row[1]), int(row[2]))
               for rank, row in enumerate(gathered) if int(row[1]) > 0}
    return Links(dist.get_rank(group), listener, nonce, holders)
