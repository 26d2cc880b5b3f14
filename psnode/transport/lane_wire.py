"""The bytes on a lane's socket (``psnode.transport.lanes``): the handshake's proofs and its opening
side, reading a buffer's worth, and writing buffers, whole or as far as the socket takes them now.

Thread-safety: functions of one socket; a socket is written by one thread at a time (its lane's
writer, or a sender that claimed it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Sequence

from psnode.errors import ProtocolError

__all__ = ["HANDSHAKE_TIMEOUT", "CONNECT_TIMEOUT", "WRITE_THROUGH_WAIT", "NONCE_BYTES", "PROOF_BYTES", "MAX_IDENTITY",
           "U16", "TAKEN", "proof", "recv_exact", "recv_bytes", "byte_views", "advance", "send_all",
           "send_while_taken", "connect_lane", "listening", "Tracker"]

HANDSHAKE_TIMEOUT = 10.0  # seconds for each step of the handshake (a peer that says nothing is dropped)
CONNECT_TIMEOUT = 10.0
# seconds a sender writing a message through may wait for room for its rest: past it, the whole
# message is copied for the lane's thread. 4 ms lets a 4 MiB part of a 16 MiB push drain on loopback
# instead of being copied (each worker 5% less CPU per round than with 1 ms; docs/benchmarks.md)
WRITE_THROUGH_WAIT = 0.004
NONCE_BYTES = 16
PROOF_BYTES = 32
MAX_IDENTITY = 512
U16 = struct.Struct("<H")
TAKEN = b"\x01"  # the acceptor's last word: it knows the opener and reads what follows


class Tracker:
    """Done once a message's buffers were handed to the kernel (or given up): until then the
    caller keeps them unchanged. The same face as ZeroMQ's message tracker (``done``, ``wait``)."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds.

        Raises:
            TimeoutError: not done by then.
        """
        if not self._event.wait(timeout):
            raise TimeoutError("the lane has not sent the message yet")

    def set(self) -> None:
        self._event.set()


def proof(key: bytes, side: bytes, job: bytes, n1: bytes, n2: bytes, opener: bytes, acceptor: bytes) -> bytes:
    parts = (side, job, n1, n2, opener, acceptor)
    message = b"".join(U16.pack(len(p)) + p for p in parts)  # lengths first: no two field splits read alike
    return hmac.new(key, message, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        EOFError: the peer closed first. OSError: as the socket does.
    """
    got, size = 0, len(view)
    recv_into = sock.recv_into
    while got < size:
        n = recv_into(view[got:])
        if n == 0:
            raise EOFError(f"the peer closed the lane after {got} of {size} bytes")
        got += n


def recv_bytes(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def byte_views(buffers: Sequence[Any]) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in buffers if len(b)]


def advance(views: list[memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes of ``views`` (what one ``sendmsg`` wrote)."""
    while sent:
        first = views[0]
        if sent >= len(first):
            sent -= len(first)
            views.pop(0)
        else:
            views[0] = first[sent:]
            sent = 0


def send_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Write every buffer in order (``sendmsg`` may write part of them)."""
    views = byte_views(buffers)
    while views:
        advance(views, sock.sendmsg(views))


def send_while_taken(sock: socket.socket, views: list[memoryview]) -> int:
    """Write ``views`` while the socket takes them, waiting for room no longer than
    ``WRITE_THROUGH_WAIT`` seconds in all; the bytes written (dropped from ``views``). A socket that
    fails writes nothing more here: its lane's thread meets the error."""
    sent = 0
    room = None
    while views:
        try:
            n = sock.sendmsg(views, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            if not sent:
                break  # a full socket: not a byte of this message waits for it
            if room is None:
                room = select.poll()
                room.register(sock, select.POLLOUT)
                deadline = time.monotonic() + WRITE_THROUGH_WAIT
            left = deadline - time.monotonic()
            if left <= 0 or not room.poll(left * 1000):
                break
            continue
        except OSError:
            break
        advance(views, n)
        sent += n
    return sent


def connect_lane(address: tuple[str, int] | str, magic: bytes, key: bytes, job: bytes, identity: bytes,
                 acceptor: bytes) -> socket.socket:
    """A connection to ``address`` (``(host, port)`` over TCP, or the name of a Unix socket: abstract
    when it starts with NUL) whose acceptor ``acceptor`` proved that it holds ``key`` and took it (the
    module docstring's handshake; ``magic`` names what the connection is for), blocking, with Nagle's
    algorithm off over TCP.

    Raises:
        OSError, EOFError: no connection, or it ended. ProtocolError: the acceptor's proof is wrong.
    """
    sock = _connect(address)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        n1 = os.urandom(NONCE_BYTES)
        sock.sendall(magic + U16.pack(len(identity)) + identity + U16.pack(len(acceptor)) + acceptor + n1)
        n2 = recv_bytes(sock, NONCE_BYTES)
        answer = recv_bytes(sock, PROOF_BYTES)
        if not hmac.compare_digest(answer, proof(key, b"accept", job, n1, n2, identity, acceptor)):
            raise ProtocolError("it did not prove that it holds this job's key")
        sock.sendall(proof(key, b"open", job, n1, n2, identity, acceptor))
        if recv_bytes(sock, 1) != TAKEN:
            raise ProtocolError("it did not take the connection")
        sock.settimeout(None)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except BaseException:
        sock.close()
        raise


def listening(family: int, address: Any) -> socket.socket:
    """A stream socket of ``family`` bound to ``address`` and listening.

    Raises:
        OSError: it cannot be bound.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def _connect(address: tuple[str, int] | str) -> socket.socket:
    if not isinstance(address, str):
        return socket.create_connection(address, timeout=CONNECT_TIMEOUT)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock
