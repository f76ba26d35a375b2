"""Length-prefixed messages over a stream socket (kernel <-> forkserver <-> ranks).

Standard library only: the forkserver imports this before torch.
"""

from __future__ import annotations

import pickle
import socket
import struct

_HEADER = struct.Struct("!Q")
_SMALL = 1 << 16


def send_bytes(sock: socket.socket, data: bytes) -> None:
    """Send one message (raises OSError if the peer is gone)."""
    header = _HEADER.pack(len(data))
    if len(data) < _SMALL:
        sock.sendall(header + data)  # one syscall for the common, small case
    else:
        sock.sendall(header)
        sock.sendall(data)


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
