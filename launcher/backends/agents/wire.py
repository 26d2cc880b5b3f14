"""The link between node 0 and an agent: framed JSON messages over one TCP connection.

**Frames.** Each message is a 4-byte big-endian length, a 32-byte tag and a JSON object (UTF-8)
of at most ``MAX_FRAME`` bytes. Once the handshake is done the tag is HMAC-SHA256 of the
direction, the message's sequence number and the JSON under a key for this connection alone, so a
frame that was forged, altered, replayed or reordered is refused (``WireError``) and the link is
dropped: nothing a stranger writes on the socket is ever acted on. Before that (the handshake's
own three messages) the tag is zeros and the messages carry their proofs themselves.

**Handshake** (``join`` on the agent, ``Admission`` on node 0):

1. the agent says ``hello``: protocol version, job id, node rank and count, a fresh nonce, and
   whether it holds a key;
2. node 0 answers ``challenge``: its own nonce and its proof, HMAC(key, "node0" | both nonces |
   job id): an agent never takes orders from a process that does not hold the key;
3. the agent answers ``proof``: HMAC(key, "agent" | both nonces | job id | its rank); node 0
   refuses a wrong one before it reads anything else from the agent;
4. both derive the connection's key from the job key and both nonces, and node 0 says
   ``welcome`` (or ``refused``, with why: another job, a rank taken, a different command).

Neither proof reveals the key, and the nonces make each one good for one connection only. The
link is authenticated and tamper-proof, not encrypted: it carries process output and control
words, never the key, nor a value of ``--env`` (each agent reads those from its own command
line). Without a key (allowed only when node 0 is on a loopback address) the proofs use an empty
key: they then protect against nothing but mistakes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
from typing import Any

__all__ = ["Channel", "WireError", "LinkClosed", "Refused", "PROTOCOL", "MAX_FRAME", "new_nonce", "proof",
           "session_key"]

#: The version both sides must speak; a change of the messages changes it.
PROTOCOL = 1
#: The largest JSON body a frame may carry (a block of a process's output is at most 1 MiB of text).
MAX_FRAME = 8 << 20
_TAG = 32
_NO_TAG = bytes(_TAG)


class WireError(Exception):
    """A frame that cannot be taken (malformed, too long, a wrong tag); the link is dropped."""


class LinkClosed(WireError):
    """The other side closed the connection, or it broke."""


class Refused(Exception):
    """The other side refused this agent, or node 0 did not prove it holds the job's key; the
    message says why, naming values (never the key)."""


def new_nonce() -> str:
    """16 random bytes as hex: one side's share of a connection's key."""
    return os.urandom(16).hex()


def proof(key: bytes, who: str, *parts: str) -> str:
    """``who``'s proof that it holds ``key``, bound to ``parts`` (the nonces, the job, the rank)."""
    return hmac.new(key, "|".join((f"pslaunch-agents-{PROTOCOL}", who, *parts)).encode(), hashlib.sha256).hexdigest()


def session_key(key: bytes, agent_nonce: str, node0_nonce: str) -> bytes:
    """The key that tags every later frame of one connection."""
    return hmac.new(key, f"pslaunch-agents-session|{agent_nonce}|{node0_nonce}".encode(), hashlib.sha256).digest()


class Channel:
    """One end of the link. ``send`` is thread-safe; ``receive`` is called by one thread only."""

    def __init__(self, sock: socket.socket, peer: str, outgoing: str) -> None:
        """``peer``: how errors name the other side; ``outgoing``: this side's direction word
        (``to-agent`` on node 0, ``to-node0`` on an agent)."""
        self.sock = sock
        self.peer = peer
        self._out = outgoing.encode()
        self._in = (b"to-node0" if outgoing == "to-agent" else b"to-agent")
        self._key: bytes | None = None
        self._sent = 0
        self._received = 0
        self._send_lock = threading.Lock()
        self._closed = False

    def secure(self, key: bytes) -> None:
        """From now on every frame is tagged with ``key`` (``session_key``) both ways."""
        self._key = key

    def _tag(self, direction: bytes, number: int, body: bytes) -> bytes:
        if self._key is None:
            return _NO_TAG
        return hmac.new(self._key, direction + struct.pack(">Q", number) + body, hashlib.sha256).digest()

    def send(self, message: dict[str, Any]) -> None:
        """Send one message. Raises ``LinkClosed`` when the connection is gone."""
        body = json.dumps(message, separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise WireError(f"a {message.get('t')!r} message of {len(body)} bytes is over the {MAX_FRAME}-byte frame limit")
        with self._send_lock:
            frame = struct.pack(">I", len(body)) + self._tag(self._out, self._sent, body) + body
            try:
                self.sock.sendall(frame)
            except OSError as exc:
                raise LinkClosed(f"the connection to {self.peer} broke: {exc.strerror or exc}") from None
            self._sent += 1

    def _read(self, count: int) -> bytes:
        chunks, got = [], 0
        while got < count:
            try:
                chunk = self.sock.recv(min(count - got, 1 << 20))
            except socket.timeout:
                raise
            except OSError as exc:
                raise LinkClosed(f"the connection to {self.peer} broke: {exc.strerror or exc}") from None
            if not chunk:
                raise LinkClosed(f"{self.peer} closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message (blocking; up to ``timeout`` seconds when given: ``socket.timeout``).

        Raises ``WireError`` for a frame that is too long, not a JSON object, or wrongly tagged, and
        ``LinkClosed`` at the end of the connection."""
        self.sock.settimeout(timeout)
        header = self._read(4 + _TAG)
        self.sock.settimeout(None if timeout is None else max(timeout, 5.0))  # the rest of a frame comes soon
        (length,) = struct.unpack(">I", header[:4])
        if length > MAX_FRAME:
            raise WireError(f"{self.peer} sent a frame of {length} bytes, over the {MAX_FRAME}-byte limit")
        body = self._read(length)
        if not hmac.compare_digest(header[4:], self._tag(self._in, self._received, body)):
            raise WireError(f"{self.peer} sent a frame whose tag does not match (forged, altered or out of order)")
        self._received += 1
        try:
            message = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            raise WireError(f"{self.peer} sent a frame that is not JSON") from None
        if not isinstance(message, dict) or not isinstance(message.get("t"), str):
            raise WireError(f"{self.peer} sent a message without a type: {body[:80]!r}")
        return message

    def close(self) -> None:
        """Close the connection (wakes a thread blocked in ``receive``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
