"""Lanes: plain TCP streams between two nodes for big data messages, read where they belong.

**Why.** ZeroMQ copies nothing it need not, but every big message still passes its I/O thread
on both sides (a hand-off per message each way, a buffer allocated per received message) and the
receiver then copies it to where it belongs. A ring allreduce of 4 workers on 2 cores is bound by
that CPU: a bare pyzmq ring spent 80 ms of CPU per 64 MiB allreduce and worker where the same ring
over plain sockets, each segment read straight into its destination, spent 50 ms (and gloo, which
does the latter, 60 ms; docs/benchmarks.md). So the collectives send their big segments over lanes
when a peer is reached over TCP; everything else keeps ZeroMQ. A job's big pushes and pull replies
between workers and servers take lanes of their own the same way (``psnode.node.data_lanes``).

**A lane** is one TCP connection that carries messages one way, from the worker that opened it to
the one that accepted it; each ordered pair of workers has at most one. Every worker listens on a
port of its own (``PeerInfo.lane_port`` in the address book; 0 when it has none).

**Handshake** (before a byte of data is read; each step within ``HANDSHAKE_TIMEOUT``)::

    opener   -> acceptor: MAGIC, u16 length + opener's identity, u16 length + acceptor's identity,
                          16-byte nonce N1
    acceptor -> opener:   16-byte nonce N2, HMAC(lane key, "accept" | job | N1 | N2 | identities)
    opener   -> acceptor: HMAC(lane key, "open" | job | N1 | N2 | identities)
    acceptor -> opener:   1 (the opener is a node of the job this acceptor knows; what follows is read)

The lane key is derived from the job key (``Security.lane_key``), so only a holder of the key
opens a lane, and the opener knows that what answered is the job's worker, not a process that took
over the port. Without a key (loopback only, as for ZeroMQ) the MACs are keyed with the empty key:
they keep other protocols' bytes out, not other users. Under ``PSLAUNCH_ENCRYPT=curve`` there are no
lanes (their bytes would be in the clear).

**Messages** after the handshake: a fixed-size prefix (its size, ``Receiver.prefix_size``, and its
meaning are the receiver's), then a body whose length the receiver derives from the prefix (``parse``). The
receiver checks the prefix before a byte of the body is read, may name where the body goes (read
straight into it), and gets the message. Whatever it refuses closes the lane: a stream whose framing
is in doubt cannot be trusted further. Nothing a peer sends makes this process allocate more than the
receiver's ``parse`` allows.

**Failure.** A lane that cannot be opened or breaks hands what it still holds to the ``fallback``
the caller gave (the collectives resend it through ZeroMQ) and is not used again: a peer that died
is the scheduler's to announce. Senders never block: each lane has its own thread and queue. A sender
may also write a message itself when its lane is idle (``write_through``): the kernel's copy is then
the only one, and the lane's thread writes what the socket did not take at once.

The bytes themselves (the handshake's proofs and its opening side, reads and writes of buffers) are
``psnode.transport.lane_wire``'s. Threads: one accepting thread, one per accepted lane, one per opened
lane. ``Lanes`` is thread-safe.
"""

from __future__ import annotations

import hmac
import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

from psnode.errors import ProtocolError, PSNodeError
from psnode.log import logger
from psnode.transport.lane_wire import (
    CONNECT_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    MAX_IDENTITY,
    NONCE_BYTES,
    PROOF_BYTES,
    TAKEN,
    U16,
    Tracker,
    advance,
    byte_views,
    connect_lane,
    listening,
    proof,
    recv_bytes,
    recv_exact,
    send_all,
    send_while_taken,
)

__all__ = ["Lanes", "Receiver", "Tracker", "MAGIC", "HANDSHAKE_TIMEOUT", "CONNECT_TIMEOUT"]

MAGIC = b"PSLANE\x01\x00"
_SMALL = 4096  # bytes of a buffer copied as bytes, not into a lane's spare buffer
MAX_HANDSHAKES = 32  # handshakes under way at once; more connections are closed at once


class Receiver(Protocol):
    """What reads a lane's messages (the collectives' ``lane_path.LanePath``). Every method runs on
    the lane's own thread; ``peer`` is what ``Lanes.serve``'s ``known`` returned for the opener."""

    prefix_size: int

    def parse(self, peer: Any, prefix: bytes) -> tuple[int, Any]:
        """The bytes of the body that follows ``prefix``, and what the prefix says (the receiver's
        own, handed back to ``destination`` and ``deliver``).

        Raises:
            ProtocolError: a prefix this worker does not take (the lane closes; the message names why).
        """

    def destination(self, peer: Any, message: Any, size: int) -> Any:
        """A writable buffer of ``size`` bytes the body is read straight into, or None."""

    def deliver(self, peer: Any, message: Any, body: Any) -> None:
        """Take one whole message (``body``: the destination, or a buffer of the lane's)."""

    def refused(self, peer: Any, prefix: bytes, why: str) -> None:
        """The lane from ``peer`` closes because of what it sent: the message that begins with
        ``prefix`` (``why`` names what was wrong)."""


class _OutLane:
    """The lane this worker opened to one peer: a queue and the thread that writes it."""

    def __init__(self, owner: "Lanes", identity: bytes, address: tuple[str, int], describe: str,
                 fallback: Callable[[list], None]) -> None:
        self.owner = owner
        self.identity = identity
        self.address = address
        self.describe = describe
        self.fallback = fallback
        # messages to write, in order (None: end the lane), and whether the socket is being written
        # (by this lane's thread, or by a sender writing through): both under the owner's lock
        self.items: deque = deque()
        self.ready = threading.Condition(owner._lock)
        self.busy = False
        self.failed = False
        self.sock: socket.socket | None = None
        self._spare: bytearray | None = None  # where a message written through keeps its rest (``_copy``)
        self.thread = threading.Thread(target=self._run, name=f"psnode-lane-to-{describe}", daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket:
        owner = self.owner
        return connect_lane(self.address, owner.magic, owner.key, owner.job, owner.identity, self.identity)

    def _run(self) -> None:
        try:
            self.sock = self._open()
        except (OSError, EOFError, ProtocolError) as exc:
            self._give_up(f"cannot open a lane to {self.describe} at {self.address[0]}:{self.address[1]}: {exc}", [],
                          warn=True)
            return
        sock = self.sock
        while True:
            with self.ready:
                while not self.items or self.busy:
                    self.ready.wait()
                item = self.items.popleft()
                if item is None:
                    break
                self.busy = True
            buffers, tracker, _ = item
            try:
                send_all(sock, buffers)
            except OSError as exc:  # the peer cannot have read this message whole: it goes again
                self._give_up(f"the lane to {self.describe} broke: {exc}", [item], warn=False)
                return
            except Exception as exc:  # a bug: the lane's messages must still go, or their ops would wait
                self._give_up(f"the lane to {self.describe} failed: {type(exc).__name__}: {exc}", [item], warn=True)
                return
            with self.ready:
                self.busy = False
            tracker.set()
        try:
            sock.shutdown(socket.SHUT_WR)  # what the kernel holds still reaches the peer
        except OSError:
            pass
        sock.close()

    def write_through(self, buffers: list) -> Tracker | None:
        """``Lanes.write_through`` on this lane, which the caller claimed (``busy``)."""
        views = byte_views(buffers)
        left = list(views)
        sent = send_while_taken(self.sock, left)
        if not sent:
            self._release(None)
            return None
        tracker = Tracker()
        if left:
            # the kernel took a part: this lane's thread writes the rest from a copy of the whole
            # message, which also goes again through the fallback should the lane break before the end
            whole = self._copy(views)
            rest = list(whole)
            advance(rest, sent)
            self._release((rest, tracker, whole))
            return tracker
        self._release(None)
        tracker.set()
        return tracker

    def _copy(self, views: list[memoryview]) -> list[memoryview]:
        """``views`` copied: the big ones into this lane's spare buffer (free again, since the lane
        was idle: the message that used it before was written, or the lane failed and takes no more)."""
        size = sum(len(view) for view in views if len(view) > _SMALL)
        if self._spare is None or len(self._spare) < size:
            self._spare = bytearray(size)
        spare = memoryview(self._spare)
        whole, at = [], 0
        for view in views:
            if len(view) > _SMALL:
                spare[at:at + len(view)] = view
                whole.append(spare[at:at + len(view)])
                at += len(view)
            else:
                whole.append(memoryview(bytes(view)))
        return whole

    def _release(self, first: Any) -> None:
        """End a sender's claim; ``first``: a message this lane's thread writes before the others."""
        with self.ready:
            if first is not None:
                self.items.appendleft(first)
            self.busy = False
            if self.items:
                self.ready.notify()

    def _give_up(self, why: str, unsent: list, warn: bool) -> None:
        """Use this lane no more: what it holds goes through the fallback, in order (and, with the
        owner's ``in_order``, before anything sent after this lane failed)."""
        with self.owner._lock:
            self.failed = True  # ``Lanes.send`` queues nothing more here
            unsent.extend(item for item in self.items if item is not None)
            self.items.clear()
            closing = self.owner.closed
            if warn and not closing:
                logger.warning("%s; %s to it go through ZeroMQ", why, self.owner.what)
            else:
                logger.info("%s", why)
            if self.owner.in_order:  # a sender waits for the lock, then takes the other path: after these
                self._resend(unsent, closing)
                return
        self._resend(unsent, closing)

    def _resend(self, unsent: list, closing: bool) -> None:
        for _, tracker, whole in unsent:
            if not closing:
                try:
                    self.fallback(list(whole))
                except PSNodeError as exc:  # the peer is gone too: the scheduler says so
                    logger.info("resending a message for %s failed: %s", self.describe, exc)
                except Exception as exc:  # a bug: say it, and still free the message's op
                    logger.error("resending a message for %s failed: %s: %s", self.describe, type(exc).__name__, exc)
            tracker.set()
        if self.sock is not None:
            self.sock.close()


class Lanes:
    """This worker's lanes: the port it listens on, the lanes it opened and those it accepted.

    ``Lanes.listen`` binds; ``serve`` starts accepting once something reads (``Receiver``);
    ``send`` queues a message and returns at once.
    """

    def __init__(self, sock: socket.socket, identity: bytes, job: str, key: bytes, what: str = "collectives",
                 in_order: bool = False, magic: bytes = MAGIC) -> None:
        self._listener = sock
        self.magic = magic  # what a connection to this port must open with (lanes and streams differ)
        self.what = what  # what the lanes carry, for the log
        # a failed lane's messages are sent again before any later one to that peer: the receiver
        # relies on the order of one sender's messages
        self.in_order = in_order
        self.port = sock.getsockname()[1] if sock.family != socket.AF_UNIX else 0  # 0: a Unix socket (``listen_local``)
        self.identity = identity
        self.job = job.encode()
        self.key = key
        self.closed = False
        self._lock = threading.Lock()
        self._out: dict[bytes, _OutLane] = {}
        self._in: dict[bytes, socket.socket] = {}  # the lane each peer opened to this worker
        self._receiver: Receiver | None = None
        self._known: Callable[[bytes], Any] | None = None
        self._accepting: threading.Thread | None = None
        self._handshaking = 0  # connections accepted whose handshake is under way
        self._refusals = 0  # refused since the last one logged
        self._next_refusal_log = 0.0

    @classmethod
    def listen(cls, host: str, identity: bytes, job: str, key: bytes, what: str = "collectives",
               in_order: bool = False, magic: bytes = MAGIC) -> "Lanes":
        """Listen on a free port of ``host`` ('' for every interface); ``what``, ``in_order`` and
        ``magic``: see ``__init__``.

        Raises:
            OSError: the port cannot be bound.
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return cls(listening(family, (host, 0)), identity, job, key, what, in_order, magic)

    @classmethod
    def listen_local(cls, name: str, identity: bytes, job: str, key: bytes, what: str = "collectives",
                     in_order: bool = False, magic: bytes = MAGIC) -> "Lanes":
        """Listen on the abstract Unix socket ``name`` (Linux; the name lives in this network namespace
        and goes with the socket): for peers on this host, whose messages then skip the TCP stack.
        The handshake is the same as over TCP.

        Raises:
            OSError: it cannot be bound (the name is taken, or no abstract namespace here).
        """
        return cls(listening(socket.AF_UNIX, "\0" + name), identity, job, key, what, in_order, magic)

    # ---- receiving -------------------------------------------------------------------------------
    def serve(self, receiver: Any, known: Callable[[bytes], Any]) -> None:
        """Accept lanes and read them with ``receiver`` (a ``Receiver``; or anything with
        ``adopt(peer, sock)``, which then takes each connection once its handshake is done and reads it
        itself); ``known(identity)`` is the peer of that identity in the job (None: not a member; it is
        asked again until the handshake's time is up, since a peer may open its lane before this
        worker has the address book)."""
        with self._lock:
            if self._accepting is not None or self.closed:
                return
            self._receiver, self._known = receiver, known
            self._accepting = threading.Thread(target=self._accept, name="psnode-lanes-accept", daemon=True)
            self._accepting.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, address = self._listener.accept()
            except OSError:
                return  # closed
            where = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else "a Unix socket of this host"
            with self._lock:
                busy = self._handshaking >= MAX_HANDSHAKES
                if not busy:
                    self._handshaking += 1
            if busy:  # a flood of connections that do not finish their handshake: no thread each
                self._refuse(where, f"{MAX_HANDSHAKES} handshakes are already under way")
                sock.close()
                continue
            threading.Thread(target=self._read, args=(sock, where), name=f"psnode-lane-from-{where}",
                             daemon=True).start()

    def _refuse(self, where: str, why: str) -> None:
        """Log a refused connection: at most one line a second, with how many were not logged."""
        now = time.monotonic()
        with self._lock:
            self._refusals += 1
            if now < self._next_refusal_log:
                return
            self._next_refusal_log = now + 1.0
            unlogged, self._refusals = self._refusals - 1, 0
        more = f" ({unlogged} more refused in the last second, not logged)" if unlogged else ""
        logger.warning("refused a lane from %s: %s%s", where, why, more)

    def _handshake(self, sock: socket.socket) -> tuple[bytes, Any]:
        """The opener's identity and peer, once it proved that it holds the key.

        Raises:
            ProtocolError, OSError, EOFError: it did not (the message names what).
        """
        sock.settimeout(HANDSHAKE_TIMEOUT)
        magic = recv_bytes(sock, len(self.magic))
        if magic != self.magic:
            raise ProtocolError(f"it did not open a {self.what} connection (its first bytes were {magic[:8]!r})")
        identities = []
        for _ in range(2):
            (length,) = U16.unpack(recv_bytes(sock, 2))
            if length > MAX_IDENTITY:
                raise ProtocolError(f"it sent an identity of {length} bytes (at most {MAX_IDENTITY})")
            identities.append(recv_bytes(sock, length))
        opener, acceptor = identities
        if acceptor != self.identity:
            raise ProtocolError(f"it meant to reach {acceptor.decode(errors='replace')!r}")
        n1 = recv_bytes(sock, NONCE_BYTES)
        n2 = os.urandom(NONCE_BYTES)
        sock.sendall(n2 + proof(self.key, b"accept", self.job, n1, n2, opener, self.identity))
        answer = recv_bytes(sock, PROOF_BYTES)
        if not hmac.compare_digest(answer, proof(self.key, b"open", self.job, n1, n2, opener, self.identity)):
            raise ProtocolError("it did not prove that it holds this job's key")
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        peer = self._known(opener)
        while peer is None and time.monotonic() < deadline and not self.closed:
            time.sleep(0.01)
            peer = self._known(opener)
        if peer is None:
            raise ProtocolError(f"{opener.decode(errors='replace')!r} is not a node of this job that sends on lanes here")
        sock.sendall(TAKEN)
        sock.settimeout(None)
        return opener, peer

    def _read(self, sock: socket.socket, where: str) -> None:
        try:
            opener, peer = self._handshake(sock)
        except (OSError, EOFError, ProtocolError) as exc:
            self._refuse(where, str(exc))
            sock.close()
            return
        finally:
            with self._lock:
                self._handshaking -= 1
        adopt = getattr(self._receiver, "adopt", None)
        if adopt is not None:  # the receiver reads the connection itself (``psnode.transport.streams``)
            if self.closed:
                sock.close()
            else:
                adopt(peer, sock)
            return
        with self._lock:
            old = self._in.get(opener)
            if self.closed:
                sock.close()
                return
            self._in[opener] = sock
        if old is not None:  # the peer opened it again: its first lane is over
            old.close()
        receiver = self._receiver
        prefix_size = receiver.prefix_size
        prefix_buf = bytearray(prefix_size)
        prefix_view = memoryview(prefix_buf)
        scratch = bytearray(0)
        prefix = b""
        try:
            while True:
                recv_exact(sock, prefix_view)
                prefix = bytes(prefix_buf)
                size, message = receiver.parse(peer, prefix)
                body = receiver.destination(peer, message, size) if size else None
                if body is None:
                    # The lane's own buffer, reused while nobody kept the last message's: a deliver
                    # that keeps it (a collective not started here yet) holds a reference to it.
                    if len(scratch) < size or sys.getrefcount(scratch) > 2:
                        scratch = bytearray(size)
                    body = memoryview(scratch)[:size]
                    recv_exact(sock, body)
                else:
                    recv_exact(sock, memoryview(body).cast("B"))
                receiver.deliver(peer, message, body)
                del body, message
        except ProtocolError as exc:
            logger.warning("closed the lane from %s: %s", where, exc)
            receiver.refused(peer, prefix, str(exc))
        except (OSError, EOFError):
            pass  # closed by the peer or by this worker: a dead peer is the scheduler's to announce
        except Exception as exc:  # a bug: say it, and stop reading this lane
            logger.error("the lane from %s failed: %s: %s", where, type(exc).__name__, exc)
            receiver.refused(peer, prefix, f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                if self._in.get(opener) is sock:
                    del self._in[opener]
            sock.close()

    # ---- sending ---------------------------------------------------------------------------------
    def send(self, identity: bytes, address: tuple[str, int], describe: str, buffers: list,
             fallback: Callable[[list], None]) -> Tracker | None:
        """Queue ``buffers`` (one message) for the peer ``identity`` at ``address`` (its lane opened on
        first use); a tracker, done once they were written, or None when the lane to that peer
        failed before (send through the other path). ``fallback(buffers)`` sends a message the lane
        could not, through the other path. Never blocks; the buffers must stay unchanged until the
        tracker is done."""
        with self._lock:
            if self.closed:
                return None
            lane = self._out.get(identity)
            if lane is None:
                lane = self._out[identity] = _OutLane(self, identity, address, describe, fallback)
            elif lane.failed:
                return None
            tracker = Tracker()
            lane.items.append((buffers, tracker, buffers))  # under the lock: a lane that fails after this drains it
            lane.ready.notify()
        return tracker

    def write_through(self, identity: bytes, buffers: list) -> Tracker | None:
        """Write one message for the peer ``identity`` from ``buffers`` on the calling thread, when
        its lane is open and idle (nothing queued or being written) and the kernel takes a part of it
        at once, without waiting for the peer: a tracker, after which the buffers may change (no
        reference to them is kept). It is done when the kernel took the whole message; else the
        lane's thread writes the rest from a copy (of the whole message: a lane that breaks before
        the end hands it to its fallback, as it does ``send``'s). None: nothing was written (no lane
        opened yet, a failed one, one in use, or a socket that takes nothing now): ``send`` a copy.
        """
        with self._lock:
            lane = self._out.get(identity)
            if self.closed or lane is None or lane.failed or lane.sock is None or lane.busy or lane.items:
                return None
            lane.busy = True
        return lane.write_through(buffers)

    def close(self) -> None:
        """Stop accepting and reading, and end the opened lanes once they wrote what they hold (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            outs = list(self._out.values())
            ins = list(self._in.values())
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in ins:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for lane in outs:
            with lane.ready:
                lane.items.append(None)
                lane.ready.notify()
