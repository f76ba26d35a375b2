"""Length-prefixed messages over a stream socket (kernel <-> forkserver <-> ranks).

Standard library only: the forkserver imports this before torch. A send to a
peer that does not read blocks once the socket's buffer is full: the kernel's
calls go through `send_bytes_by`, which gives up at a deadline.
"""

from __future__ import annotations

import math
import pickle
import select
import socket
import struct
import time

_HEADER = struct.Struct("!Q")
_SMALL = 1 << 16
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


class Stalled(TimeoutError):
    """A send that did not finish by its deadline: the peer is not reading."""

    def __init__(self, sent: int, total: int):
        super().__init__(f"sent {sent} of {total} bytes before the deadline")
        self.sent, self.total = sent, total


def send_bytes(sock: socket.socket, data: bytes) -> None:
    """Send one message (raises OSError if the peer is gone)."""
    header = _HEADER.pack(len(data))
    if len(data) < _SMALL:
        sock.sendall(header + data)  # one syscall for the common, small case
    else:
        sock.sendall(header)
        sock.sendall(data)


def send_bytes_by(sock: socket.socket, data: bytes, deadline: float,
                  wake: int | None = None, on_wake=None) -> None:
    """send_bytes, bounded: raises Stalled if the message is not all sent by
    `deadline` (time.monotonic()). While it waits, the file descriptor `wake`
    becoming readable calls `on_wake()`, which may raise to give up. The socket
    stays blocking (each send is MSG_DONTWAIT). After an exception the stream is
    cut mid-message: drop the connection."""
    header = _HEADER.pack(len(data))
    parts = (header + data,) if len(data) < _SMALL else (header, data)
    total, sent, poller = len(header) + len(data), 0, None
    for part in parts:
        view = memoryview(part)
        while view:
            try:
                n = sock.send(view, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                n = 0
            if n:
                view, sent = view[n:], sent + n
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise Stalled(sent, total)
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
                if wake is not None:
                    poller.register(wake, select.POLLIN)
            events = poller.poll(math.ceil(left * 1000))
            if wake is not None and any(fd == wake for fd, _ in events):
                on_wake()


def recv_bytes(sock: socket.socket) -> bytearray | None:
    """Receive one message; None when the peer closed the connection."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (n,) = _HEADER.unpack(header)
    return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (ConnectionResetError, BrokenPipeError):
            return None
        if k == 0:
            return None
        got += k
    return buf


def send(sock: socket.socket, obj) -> None:
    """Send a plain-pickled object (stdlib data only; user objects use cloudpickle)."""
    send_bytes(sock, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(sock: socket.socket):
    """Receive a plain-pickled object; None when the peer closed the connection."""
    data = recv_bytes(sock)
    return None if data is None else pickle.loads(data)
