"""Streams: one connection between a worker and a server that the two nodes' own threads read and write.

**Why.** Over ZeroMQ a message passes an I/O thread on each side: the sending thread hands it to
its I/O thread, which writes the socket; the receiving I/O thread reads it and wakes the node's
thread. A small message's round trip is mostly those four hand-offs. A ``dist_sync`` round of a
4-element key (2 workers, one server, 127.0.0.1, 2 cores) took 94-122 µs over raw pyzmq and 21 µs
over plain sockets that the processes' own threads poll (docs/benchmarks.md, "Where the time
goes"). So a worker opens a stream to each server it knows, and every message between the two goes
on it, both ways, in order; their ZeroMQ connection then carries none of them.

**Opening** (``psnode.node.connection``): a worker opens its stream to a server when the address book
names the server, before it sends that server anything, with the handshake of
``psnode.transport.lanes`` (a proof of the job key both ways, ``MAGIC``); the server answers once
it knows the worker and has the stream. A stream that cannot be opened is said in the log and that
server's messages go through ZeroMQ. A worker on the server's host (``membership.on_this_host``)
opens it on the server's abstract Unix socket (``stream_socket`` in the address book) instead of
TCP, which skips the TCP stack both ways: the round trip of a 4-element key on one host, 2 cores,
each process on a core of its own, went from 158-167 to 139-145 µs (docs/benchmarks.md). It falls
back to TCP when that socket cannot be opened.

**Wire.** Each message: u64 bytes of what follows, u16 frame count, a u64 length per frame, the
frames. ``Stream.read`` checks the count (``MAX_FRAMES``) and the lengths (each within the node's
frame limit, as ZeroMQ checks each frame) before it keeps a byte of the message; what does not parse closes the stream.

**Reading.** The transport's ``poll`` waits on each stream's socket beside ZeroMQ's, and reads the
ready ones without blocking, at most ``READ_MAX`` bytes a stream per poll; whole messages go to the
transport's inbox, a partial one waits for its rest. ``poll`` reads only while the inbox is empty,
so a sender faster than this node feels TCP's back-pressure, as past ZeroMQ's high-water mark.

**Writing.** Any thread, under the stream's lock. What the kernel does not take at once is queued (a
view of the caller's buffers, as ZeroMQ keeps them) and written by the next thread that polls once
the socket can take it, or by a blocking sender itself while more than ``QUEUE_MAX`` bytes wait. A
``track``ed send returns a ``Tracker`` that is done once the kernel has the message.

**Failure.** A stream that ends or sends what does not parse is closed and its queued messages are
dropped (as ZeroMQ drops what it queued for a connection that ended); the pair's messages from then
on go through ZeroMQ. A peer that died is the scheduler's to announce; a malformed stream is
counted against its sender.

Thread-safety: ``send`` and ``shutdown`` from any thread; ``read``, ``flush`` and ``close`` from the
thread that polls (``send`` may flush too, under the lock).
"""

from __future__ import annotations

import random
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from psnode.errors import ProtocolError, WouldBlock
from psnode.log import logger
from psnode.transport.base import Frame
from psnode.transport.lane_wire import Tracker, connect_lane

__all__ = ["Stream", "StreamSet", "connect_stream", "MAGIC", "MAX_FRAMES", "QUEUE_MAX", "READ_MAX", "pack_header"]

MAGIC = b"PSSTRM\x01\x00"
TRIES = 3  # tries to open a stream (``connect_stream``)
MAX_FRAMES = 64  # frames in one message (the protocol's messages have at most a handful)
QUEUE_MAX = 64 << 20  # bytes a stream queues before a blocking send waits (a non-blocking one: WouldBlock)
READ_MAX = 1 << 20  # bytes one poll reads from a stream at most, so every stream and ZeroMQ get their turn
_SOCKET_BUFFER = 4 << 20  # kernel buffer each way: a big message in fewer wake-ups (capped by the kernel)
_CHUNK = 64 << 10  # a stream's receive buffer; a message bigger than half of it is read into its own memory
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)  # zmq_poll's, which it takes for a plain descriptor too
_HEAD = struct.Struct("<QH")
_LENGTHS = [struct.Struct(f"<{n}Q") for n in range(MAX_FRAMES + 1)]


def connect_stream(address: tuple[str, int] | str, key: bytes, job: bytes, identity: bytes, server: bytes,
                   tries: int = TRIES) -> socket.socket:
    """A worker's stream to ``server`` at ``address`` (``(host, port)``, or the server's Unix socket on
    this host; ``lanes.connect_lane`` with this module's ``MAGIC``). A server takes a bounded number of handshakes at once (``lanes.MAX_HANDSHAKES``) and
    closes the others, which a burst of workers that got the address book together may meet: a
    connection refused or closed is tried again, ``tries`` times in all, a moment later each time.

    Raises:
        OSError, EOFError: no try got through (the last one's error); TimeoutError: no answer.
        ProtocolError: the server's proof is wrong.
    """
    attempt = 1
    while True:
        try:
            return connect_lane(address, MAGIC, key, job, identity, server)
        except TimeoutError:
            raise  # nothing answers: another try would wait as long again
        except (OSError, EOFError):
            if attempt >= tries:
                raise
        time.sleep(random.uniform(0.02, 0.1) * attempt)
        attempt += 1


def pack_header(sizes: Sequence[int]) -> bytes:
    """The bytes before a message of frames of ``sizes`` bytes."""
    count = len(sizes)
    return _HEAD.pack(2 + 8 * count + sum(sizes), count) + _LENGTHS[count].pack(*sizes)


class Stream:
    """One stream (see the module docstring): ``peer`` is the identity of the node at its other end,
    ``sock`` a connected socket whose handshake is done, ``limit`` the largest frame taken (bytes)."""

    def __init__(self, peer: bytes, sock: socket.socket, limit: int) -> None:
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.limit = limit
        self.closed = False
        self.lock = threading.Lock()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # a small message goes at once, not held by Nagle's algorithm for the ACK of the last one
            # (which the peer may delay by up to 40 ms)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
            except OSError:
                pass
        sock.setblocking(False)
        # writing: views still to write, in order, and trackers with the byte count that completes each
        self._queue: deque[memoryview] = deque()
        self.queued = 0  # bytes in _queue
        self._written = 0  # bytes written since the stream opened
        self._ends = 0  # bytes ever handed to send: where the last message ends
        self._trackers: deque[tuple[int, Tracker]] = deque()
        # reading: the receive buffer and the bytes of it not parsed yet; a big message's own memory
        self._buf = bytearray(_CHUNK)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._big: memoryview | None = None  # a message read into memory of its own
        self._big_got = 0
        self._big_counts: tuple[int, ...] = ()
        self.sent = 0  # messages sent on the stream
        self.received = 0  # messages read from it

    # ---- writing ---------------------------------------------------------------------------------
    def send(self, frames: Sequence[Any], track: bool, block: bool) -> Tracker | None:
        """Write ``frames`` (one message) or queue what the kernel does not take; a tracker when
        ``track`` (done once the kernel has all of it).

        Raises:
            WouldBlock: ``block`` is False and ``QUEUE_MAX`` bytes wait already.
            OSError: the stream is closed or broke (the caller sends the message another way).
        """
        views = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
        if len(views) > MAX_FRAMES:
            raise ValueError(f"a message of {len(views)} frames; a stream carries {MAX_FRAMES} at most")
        sizes = [len(v) for v in views]
        head = pack_header(sizes)
        total = len(head) + sum(sizes)
        tracker = Tracker() if track else None
        with self.lock:
            if self.closed:
                raise OSError(f"the stream to {self.peer.decode(errors='replace')} is closed")
            if self.queued > QUEUE_MAX:
                if not block:
                    raise WouldBlock(f"the stream to {self.peer.decode(errors='replace')} holds {self.queued} bytes")
                self._drain(QUEUE_MAX)
            self._ends += total
            self.sent += 1
            if not self._queue:
                written = self._write([head, *views])
                self._written += written
                if written == total:
                    if tracker is not None:
                        tracker.set()
                    return tracker
                self._queue_rest([head, *views], written)
            else:
                self._queue.append(memoryview(head))
                self._queue.extend(memoryview(v) for v in views if len(v))
                self.queued += total
            if tracker is not None:
                self._trackers.append((self._ends, tracker))
        return tracker

    def _write(self, views: list) -> int:
        """Bytes of ``views`` the kernel took now (0 when it takes none).

        Raises:
            OSError: the connection broke.
        """
        try:
            return self.sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            return 0

    def _queue_rest(self, views: list, written: int) -> None:
        for v in views:
            size = len(v)
            if written >= size:
                written -= size
                continue
            view = memoryview(v)[written:] if written else memoryview(v)
            written = 0
            self._queue.append(view)
            self.queued += len(view)

    def flush(self) -> None:
        """Write what is queued, as much as the kernel takes now (the polling thread, when the socket
        can take more).

        Raises:
            OSError: the connection broke.
        """
        with self.lock:
            if not self.closed:
                self._flush()

    def _flush(self) -> None:
        queue = self._queue
        while queue:
            batch = list(queue)[:256]
            written = self._write(batch)
            if not written:
                break
            self._written += written
            self.queued -= written
            while written:
                first = queue[0]
                if written >= len(first):
                    written -= len(first)
                    queue.popleft()
                else:
                    queue[0] = first[written:]
                    written = 0
        trackers = self._trackers
        while trackers and trackers[0][0] <= self._written:
            trackers.popleft()[1].set()

    def _drain(self, below: int) -> None:
        """Write until at most ``below`` bytes are queued (a blocking sender, under the lock)."""
        while self.queued > below and not self.closed:
            select.select([], [self.sock], [], 0.1)
            self._flush()

    # ---- reading (the polling thread) ------------------------------------------------------------
    def read(self, inbox: deque) -> int:
        """Read what the socket holds now (``READ_MAX`` bytes at most) and append each whole message to
        ``inbox`` as ``(peer, frames)``; the number appended.

        Raises:
            ProtocolError: the stream does not parse (the stream must close).
            EOFError: the peer closed the stream. OSError: it broke.
        """
        got = 0
        count = 0
        while got < READ_MAX:
            if self._big is not None:
                view = self._big[self._big_got:]
                n = self._recv_into(view)
                self._big_got += n
                got += n
                if self._big_got == len(self._big):
                    self._deliver_big(inbox)
                    count += 1
                if n < len(view):
                    break
                continue
            if self._end == len(self._buf):  # room at the end: move the unparsed bytes to the front
                rest = self._end - self._start
                self._buf[:rest] = self._buf[self._start:self._end]
                self._start, self._end = 0, rest
            room = len(self._buf) - self._end
            if not room:  # cannot be: what stays unparsed is part of one message of half the buffer at most
                raise ProtocolError("a stream message that fills its receive buffer")
            n = self._recv_into(self._view[self._end:])
            self._end += n
            got += n
            count += self._parse(inbox)
            if n < room:
                break
        return count

    def _recv_into(self, view: memoryview) -> int:
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return 0
        if n == 0 and len(view):
            raise EOFError(f"{self.peer.decode(errors='replace')} closed the stream")
        return n

    def _parse(self, inbox: deque) -> int:
        """Take the whole messages buffered; start a big one's own memory. The number taken."""
        buf, count = self._buf, 0
        while True:
            have = self._end - self._start
            if have < _HEAD.size:
                return count
            size, frames = _HEAD.unpack_from(buf, self._start)
            if frames > MAX_FRAMES or size < 2 + 8 * frames:
                raise ProtocolError(f"a stream message of {frames} frames and {size} bytes (at most {MAX_FRAMES} frames)")
            head_end = self._start + _HEAD.size + 8 * frames
            if self._end < head_end:
                return count
            counts = _LENGTHS[frames].unpack_from(buf, self._start + _HEAD.size)
            body = size - 2 - 8 * frames
            if sum(counts) != body:
                raise ProtocolError(f"a stream message whose frames of {list(counts)} bytes do not make its {body}")
            if max(counts, default=0) > self.limit:
                raise ProtocolError(f"a stream message of frames of {list(counts)} bytes, over this node's limit of "
                                    f"{self.limit} a frame")
            if self._end - head_end >= body:
                message = bytes(buf[head_end:head_end + body])
                self._start = head_end + body
                inbox.append((self.peer, _frames(memoryview(message), counts)))
                self.received += 1
                count += 1
                continue
            if body > _CHUNK // 2:  # big: read the rest straight into memory of its own
                self._big = memoryview(np.empty(body, np.uint8))  # not zeroed: every byte is read into it
                have = self._end - head_end
                self._big[:have] = buf[head_end:self._end]
                self._big_got = have
                self._big_counts = counts
                self._start = self._end = 0
            return count

    def _deliver_big(self, inbox: deque) -> None:
        inbox.append((self.peer, _frames(self._big, self._big_counts)))
        self.received += 1
        self._big = None
        self._big_got = 0

    # ---- ending ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """End the connection both ways (any thread); the polling thread then reads its end and ``close``s it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self, linger: float = 0.0) -> None:
        """Write what is queued for up to ``linger`` seconds, then close; a tracker not done yet is
        done (its message is given up). Idempotent."""
        if not self.lock.acquire(timeout=linger + 1.0):
            self.shutdown()  # a sender waits for a peer that reads nothing (``_drain``): its write now fails
            self.lock.acquire()
        try:
            if self.closed:
                return
            if linger > 0 and self._queue:
                self.sock.settimeout(linger)
                try:
                    self._flush_blocking()
                except OSError:
                    pass
            self.closed = True
            self._queue.clear()
            self.queued = 0
            while self._trackers:
                self._trackers.popleft()[1].set()
        finally:
            self.lock.release()
        self.sock.close()

    def _flush_blocking(self) -> None:
        while self._queue:
            view = self._queue.popleft()
            self.sock.sendall(view)
            self._written += len(view)


def _frames(body: memoryview, counts: Sequence[int]) -> list:
    frames, start = [], 0
    for n in counts:
        frames.append(Frame(body[start:start + n]))
        start += n
    return frames


class StreamSet:
    """A transport's streams (see the module docstring): by peer for sending, by descriptor for its poll.

    ``limit``: the largest frame taken; ``wake()`` ends the transport's poll in progress (so it waits
    on what changed); ``refused(peer, why)``: a stream closed because what its peer sent does not parse.
    The transport builds its poll list again while ``stale`` (``poll_items``) and hands what its poll
    reports of a stream to ``ready``.
    """

    def __init__(self, limit: int, wake: Callable[[], None], refused: Callable[[bytes, str], None]) -> None:
        self._limit = limit
        self._wake = wake
        self._refused = refused
        self._lock = threading.Lock()
        self._by_peer: dict[bytes, Stream] = {}  # the stream each peer's messages go on
        self._by_fd: dict[int, Stream] = {}  # every stream poll reads, those being closed too
        self._writing: set[int] = set()  # streams whose queued bytes poll waits to write
        self.stale = False  # streams, or what poll waits for on them, changed since ``poll_items``
        self._closed = False

    def get(self, peer: bytes) -> Stream | None:
        return self._by_peer.get(peer)

    def by_peer(self) -> dict[bytes, Stream]:
        """The streams in use, by peer (a copy)."""
        return dict(self._by_peer)

    def adopt(self, peer: bytes, sock: socket.socket) -> None:
        """Carry ``peer``'s messages on ``sock`` from now on; a stream it had before ends (any thread)."""
        with self._lock:
            if self._closed:
                sock.close()
                return
            stream = Stream(peer, sock, self._limit)
            old = self._by_peer.get(peer)
            self._by_peer[peer] = self._by_fd[stream.fd] = stream
            self.stale = True
        if old is not None:
            old.shutdown()
        self._wake()

    def send(self, stream: Stream, frames: Sequence[Any], track: bool, block: bool) -> Tracker | None:
        """``stream.send``; what it queued is written by the next poll (any thread).

        Raises:
            OSError: the stream broke; it is used no more (send the message another way).
            WouldBlock: as ``Stream.send``.
        """
        try:
            tracker = stream.send(frames, track, block)
        except OSError as exc:
            self.drop(stream, f"the stream to {stream.peer.decode(errors='replace')} broke: {exc}")
            raise
        if stream.queued and stream.fd not in self._writing:
            self.stale = True
            self._wake()
        return tracker

    def drop(self, stream: Stream, why: str, warn: bool = False) -> None:
        """Use ``stream`` no more: its peer's messages go the transport's other way (the polling thread
        reads its end and closes it)."""
        with self._lock:
            if self._by_peer.get(stream.peer) is stream:
                del self._by_peer[stream.peer]
            self.stale = True
        stream.shutdown()
        if not self._closed:
            (logger.warning if warn else logger.info)("%s; its messages go through ZeroMQ", why)

    def poll_items(self) -> list[tuple[int, int]]:
        """``(fd, events)`` for each stream: readable, and writable while it queues (the polling thread)."""
        with self._lock:
            self.stale = False
            self._writing = {fd for fd, stream in self._by_fd.items() if stream.queued}
            return [(fd, _POLLIN | _POLLOUT if fd in self._writing else _POLLIN) for fd in self._by_fd]

    def ready(self, fd: int, events: int, inbox: deque) -> None:
        """The polling thread: ``events`` on stream ``fd``: write what it queued, read what came into ``inbox``."""
        stream = self._by_fd.get(fd)
        if stream is None:
            return
        try:
            if events & _POLLOUT:
                stream.flush()
                if not stream.queued:
                    self.stale = True
            if events & ~_POLLOUT:
                stream.read(inbox)
        except ProtocolError as exc:
            self._end(stream, f"closed the stream from {stream.peer.decode(errors='replace')}: {exc}", warn=True)
            self._refused(stream.peer, f"{exc} (on its stream, which this node closed)")
        except (EOFError, OSError) as exc:
            self._end(stream, f"the stream to {stream.peer.decode(errors='replace')} ended: {exc}")

    def _end(self, stream: Stream, why: str, warn: bool = False) -> None:
        self.drop(stream, why, warn)
        with self._lock:
            self._by_fd.pop(stream.fd, None)
        self._writing.discard(stream.fd)
        stream.close()

    def close(self, linger: float) -> None:
        """Close every stream, writing what each queued for up to ``linger`` seconds first."""
        with self._lock:
            self._closed = True
            streams = list(self._by_fd.values())
            self._by_peer.clear()
            self._by_fd.clear()
        for stream in streams:
            stream.close(linger)
