"""The replica stream's sockets in one process: a holder's pieces land in the receiver's
tensors, a connection without the stream's nonce is dropped, and a close frees a receive
that waits on a silent holder, after which nothing lands."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import pytest
import torch

from elastic_rt.worker.trainers.replica_transfer import chunks, senders
from elastic_rt.worker.trainers.tcp_stream import _HEADER, Links

NONCE = 1234567


def _pair() -> tuple[Links, Links]:
    """A holder (rank 0) listening on loopback and a receiver (rank 1) that knows it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    return (Links(0, listener, NONCE, {0: ("127.0.0.1", port, NONCE)}),
            Links(1, None, 0, {0: ("127.0.0.1", port, NONCE)}))


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: B902 - the test looks at it
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _transfer(links: Links, tensors: list[torch.Tensor], chunk: int) -> Callable[[], int]:
    flat = [t.view(-1).view(torch.uint8) for t in tensors]
    pieces = chunks([f.numel() for f in flat], chunk)
    return lambda: links.transfer(pieces, senders(pieces, (0,)), (1,), flat.__getitem__,
                                  lambda index: None)


def test_a_holders_pieces_land_in_the_receivers_tensors_and_a_stranger_is_dropped() -> None:
    holder, receiver = _pair()
    sent = [torch.randn(1000), torch.arange(37, dtype=torch.int64)]
    got = [torch.zeros(1000), torch.zeros(37, dtype=torch.int64)]
    sending, sent_out = _in_thread(_transfer(holder, sent, 512))
    # another stream's receiver (a wrong nonce) comes first: the holder waits for its own
    port = holder.listener.getsockname()[1]  # type: ignore[union-attr]
    with socket.create_connection(("127.0.0.1", port)) as stranger:
        stranger.sendall(_HEADER.pack(NONCE + 1))
        stranger.settimeout(10)
        assert stranger.recv(1) == b""  # dropped
    receiving, received = _in_thread(_transfer(receiver, got, 512))
    for thread in (sending, receiving):
        thread.join(timeout=10)
    assert "error" not in sent_out and "error" not in received, (sent_out, received)
    assert sent_out["value"] == received["value"] == 4000 + 37 * 8
    for a, b in zip(sent, got):
        assert torch.equal(a, b)
    holder.close()
    receiver.close()


def test_a_close_frees_a_receive_from_a_silent_holder_and_nothing_lands_after() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    receiver = Links(1, None, 0, {0: ("127.0.0.1", port, NONCE)})
    got = [torch.zeros(1024)]
    receiving, received = _in_thread(_transfer(receiver, got, 4096))
    conn, _ = listener.accept()  # a holder that took the connection and hangs
    conn.settimeout(10)
    assert len(conn.recv(_HEADER.size)) == _HEADER.size  # the receiver waits for bytes now
    began = time.monotonic()
    receiver.close()
    receiving.join(timeout=5)
    assert not receiving.is_alive() and time.monotonic() - began < 2
    assert isinstance(received.get("error"), RuntimeError), received
    with pytest.raises(OSError):  # its socket is shut: late bytes have nowhere to go
        for _ in range(64):
            conn.sendall(b"\xff" * 65536)
    assert not got[0].any()
    conn.close()
    listener.close()
