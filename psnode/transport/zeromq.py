"""The ZeroMQ transport: one ROUTER socket receives, one DEALER per peer sends.

Each node binds its ROUTER on a TCP port of every interface and, when given a local name, on an
abstract-namespace IPC endpoint (``ipc://@pslaunch-<name>``: nothing on disk to clean up, gone
when the process is). Peers on the same host connect to the IPC endpoint, others over TCP. Every
DEALER carries this node's identity, so the receiving ROUTER knows who sent each message.

Frames are sent with ``copy=False`` (ZeroMQ reads the caller's buffers) and received with
``copy=False`` (``frame.buffer`` is a view of ZeroMQ's message memory). Every socket closes with
linger 0.

A message of several small frames (all ``bytes``, ``_JOIN_MAX`` bytes at most, not tracked) travels
as one ZeroMQ frame, ``_JOINED`` + u16 count + u32 lengths + the frames' bytes, and is split back on
receipt: one send and one receive call instead of one per frame, and less work for ZeroMQ's I/O
thread. A single frame that merely starts like that but does not parse arrives as it came (the
node then drops it as malformed).

``poll`` waits on the ROUTER and on an eventfd that ``wake`` writes, so another thread can end a
poll at once (the node hands its receiving role over that way, with no polling interval).

Another way for big messages (``psnode.node.data_lanes``): with a ``lane_router`` set, ``send`` first
offers it each message of four or five frames, and sends through ZeroMQ what it does not take;
messages that came that other way are handed in with ``inject`` and received before the ROUTER's.

Streams (``psnode.transport.streams``): a peer whose stream this transport holds (``adopt_stream``) gets
every message on it instead (``send_here``), and ``poll`` waits on the streams' sockets beside the
ROUTER and reads them itself: no I/O thread between the node and those peers.

Security (``psnode.transport.security``): with a job key every socket speaks PLAIN (``auth``) or CURVE
(``curve``) with credentials derived from the key, and a ZAP handler in this transport's context
admits only connections that prove the key; ZeroMQ closes the others before it buffers a frame of
them. Whatever the mode, the ROUTER refuses frames larger than ``max_message`` (the peer is
disconnected as soon as it announces one) and keeps at most ``_RECV_HWM`` messages per peer; it
listens on the address it is given, not on every interface.
"""

from __future__ import annotations

import itertools
import os
import resource
import struct
import threading
import time
from collections import deque
from typing import Any, Sequence

import zmq

from psnode.errors import ClosedError, TransportError
from psnode.transport.base import Frame, Transport, WouldBlock
from psnode.transport.security import ZAP_DOMAIN, Security, ZapHandler
from psnode.transport.streams import Stream, StreamSet

__all__ = ["ZmqTransport"]

_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_SEND_HWM = 1000  # messages queued per peer before a non-blocking send reports WouldBlock
_RECV_HWM = 1000  # messages a ROUTER keeps per peer before it stops reading that peer's connection
_NO_SECURITY = Security("none", "")
_HANDSHAKE_EVENTS = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "refused this node's credentials (another job's port, or another key)",
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "failed the security handshake (one side has a job key, the other not?)",
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "failed the security handshake",
}
_MONITOR_IDS = itertools.count()
_MAX_FILES = 1 << 20  # open files a node asks for at most (``_room_for_sockets``)
_INBOX_MAX = 64  # messages handed in another way (``inject``) and not received yet, before the hand-in waits
_SOCKET_BUFFER = 4 << 20  # kernel buffer per connection: fewer wake-ups per big message (capped by the kernel)
_JOINED = b"\x00PJ"  # starts a joined message; a message's first frame is a protocol header (b"PS...")
_JOIN_MAX = 16384  # frames totalling more than this are sent one by one
_JOIN_FRAMES = 16  # at most this many frames are joined
_COUNT = struct.Struct("<H")
_HEADS = [_JOINED + _COUNT.pack(n) for n in range(_JOIN_FRAMES + 1)]
_LENGTHS = [struct.Struct(f"<{n}I") for n in range(_JOIN_FRAMES + 1)]


def join_frames(frames: Sequence[Any]) -> bytes | None:
    """The one frame that carries ``frames`` (see the module docstring); None when they are not
    all ``bytes``, too many or too big to be joined."""
    count = len(frames)
    if count > _JOIN_FRAMES:
        return None
    total = 0
    for frame in frames:
        if type(frame) is not bytes:
            return None
        total += len(frame)
    if total > _JOIN_MAX:
        return None
    return b"".join([_HEADS[count], _LENGTHS[count].pack(*map(len, frames)), *frames])


def split_frames(view: memoryview) -> list[Frame] | None:
    """The frames a joined frame carries (views of it), or None when ``view`` is not a well-formed one."""
    size = len(view)
    if size < 5 or view[:3] != _JOINED:
        return None
    (count,) = _COUNT.unpack_from(view, 3)
    start = 5 + 4 * count
    if count > _JOIN_FRAMES or size < start:
        return None
    lengths = _LENGTHS[count].unpack_from(view, 5)
    if start + sum(lengths) != size:
        return None
    parts = []
    for n in lengths:
        parts.append(Frame(view[start:start + n]))
        start += n
    return parts


def _room_for_sockets(context: zmq.Context) -> None:
    """Let ``context`` hold a socket per peer of a big job. A node keeps a DEALER per peer it sends to
    (the scheduler one per node, a server one per worker), each with its connection's file
    descriptor: ZeroMQ's default of 1,023 sockets per context, and the usual soft limit of 1,024
    open files, would stop a scheduler at about a thousand nodes. Both go as high as the process's
    hard limit allows (at most ZeroMQ's own socket limit)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = _MAX_FILES if hard == resource.RLIM_INFINITY else min(hard, _MAX_FILES)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (ValueError, OSError):
        return  # the limits stay: ZeroMQ's default then
    room = min(_MAX_FILES if soft == resource.RLIM_INFINITY else soft, context.get(zmq.SOCKET_LIMIT))
    if room > context.get(zmq.MAX_SOCKETS):
        context.set(zmq.MAX_SOCKETS, room)


def _batch_io_threads(context: zmq.Context) -> None:
    """Run the context's I/O threads (started with its first socket) under SCHED_BATCH.

    A thread handing a message to ZeroMQ wakes the I/O thread; under the normal policy that thread
    preempts the sender at once when no core is idle, and the sender's next steps (the next
    reply, its wait) wait for it. A SCHED_BATCH thread gets its fair share of the CPU but never
    preempts on waking, so the sender finishes its turn first: two context switches fewer per
    message on a busy machine, and the same on one with idle cores (the I/O thread runs on one).
    Where the policy or the option is unknown (not Linux, an old libzmq) nothing changes.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    option = getattr(zmq, "THREAD_SCHED_POLICY", None)
    if policy is None or option is None:
        return
    try:
        context.set(option, policy)
    except zmq.ZMQError:
        pass


class ZmqTransport(Transport):
    """Frames over ZeroMQ ROUTER/DEALER sockets; see the module docstring."""

    def __init__(self, identity: bytes, io_threads: int = 1, io_sched: str = "normal", security: Security | None = None,
                 max_message: int = -1) -> None:
        super().__init__(identity)
        self._context = zmq.Context(io_threads=io_threads)
        _room_for_sockets(self._context)
        if io_sched == "batch":
            _batch_io_threads(self._context)
        self.security = security or _NO_SECURITY
        self._max_message = max_message
        self._zap = ZapHandler(self._context, self.security) if self.security.mode != "none" else None
        self._monitors: dict[bytes, zmq.Socket] = {}  # watched peers' handshake events
        self._liveness: dict[bytes, zmq.Socket] = {}  # peers whose connection's end is watched (``gone``)
        self._down_since: dict[bytes, float] = {}
        self._ended: set[bytes] = set()  # watched peers whose connection ended since ``dropped`` asked
        self._router: zmq.Socket | None = None
        self._dealers: dict[bytes, tuple[zmq.Socket, threading.Lock]] = {}
        self._connect_lock = threading.Lock()
        self._closed = False
        self._poll_items: list | None = None  # what poll waits on: the ROUTER and the wake eventfd
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()  # a wake never writes to the number of a closed (reused) fd
        # ``route(peer, frames)`` -> a tracker when it took the message (``psnode.node.data_lanes``), else None
        self.lane_router: Any = None
        self._inbox: deque = deque()  # (sender, frames) that came another way (``inject``, streams): received first
        self._inbox_room = threading.Condition()
        # ``stream_refused(peer, why)``: a stream closed because what its peer sent does not parse
        self.stream_refused: Any = None
        # peers whose messages go on a stream (``adopt_stream``), and what poll waits for on them
        self._streams = StreamSet(max_message if max_message > 0 else 1 << 62, self.wake,
                                  lambda peer, why: self.stream_refused and self.stream_refused(peer, why))

    @staticmethod
    def same_host_endpoint(local_name: str) -> str:
        return f"ipc://@pslaunch-{local_name}"

    @property
    def refused_connections(self) -> int:
        """Connections the ZAP handler turned away so far."""
        return self._zap.refused if self._zap is not None else 0

    def bind(self, port: int = 0, local_name: str | None = None, host: str | None = None) -> int:
        self._check_open()
        router = self._context.socket(zmq.ROUTER)
        router.linger = 0
        router.rcvhwm = _RECV_HWM
        router.maxmsgsize = self._max_message
        if _SOCKET_BUFFER:
            router.rcvbuf = _SOCKET_BUFFER
        self._secure_server(router)
        address = host or "*"
        try:
            if port:
                router.bind(f"tcp://{address}:{port}")
            else:
                port = router.bind_to_random_port(f"tcp://{address}")
            if local_name:
                router.bind(self.same_host_endpoint(local_name))
        except zmq.ZMQError as exc:
            router.close(0)
            where = f"TCP port {port}" if port else "a free TCP port"
            raise TransportError(f"cannot bind {where} of {address} (with local name {local_name!r}): {exc}") from exc
        self._router = router
        self._streams.stale = True
        return port

    def _secure_server(self, router: zmq.Socket) -> None:
        mode = self.security.mode
        if mode == "none":
            return
        router.zap_domain = ZAP_DOMAIN.encode()
        if mode == "auth":
            router.plain_server = True
        else:
            router.curve_secretkey = self.security.server_keys()[1]
            router.curve_server = True

    def _secure_client(self, sock: zmq.Socket) -> None:
        sec = self.security
        if sec.mode == "auth":
            username = sec.username(self.identity)
            sock.plain_username = username
            sock.plain_password = sec.password(username)
        elif sec.mode == "curve":
            public, secret = sec.client_keys()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.curve_serverkey = sec.server_keys()[0]

    def connect(self, peer: bytes, endpoint: str, watch: bool = False) -> None:
        self._check_open()
        with self._connect_lock:
            if peer in self._dealers:
                return
            sock = self._context.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = _SEND_HWM
            if _SOCKET_BUFFER:
                sock.sndbuf = _SOCKET_BUFFER
            sock.identity = self.identity
            self._secure_client(sock)
            if watch:
                self._monitors[peer] = sock.get_monitor_socket(
                    sum(_HANDSHAKE_EVENTS) | int(zmq.EVENT_HANDSHAKE_SUCCEEDED))
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(0)
                raise TransportError(f"cannot connect to {peer.decode(errors='replace')} at {endpoint}: {exc}") from exc
            self._dealers[peer] = (sock, threading.Lock())

    def send(self, peer: bytes, frames: Sequence[Any], track: bool = False, block: bool = True) -> Any:
        router = self.lane_router
        if router is not None and 4 <= len(frames) <= 5:
            tracker = router.route(peer, frames)
            if tracker is not None:
                return tracker if track else None
        return self.send_here(peer, frames, track, block)

    def write_through(self, peer: bytes, frames: list) -> Any:
        router = self.lane_router
        return router.write_through(peer, frames) if router is not None and len(frames) == 4 else None

    def send_here(self, peer: bytes, frames: Sequence[Any], track: bool = False, block: bool = True) -> Any:
        """``send`` on the peer's stream, or through ZeroMQ when it has none (not on data lanes: what
        they give back goes here)."""
        stream = self._streams.get(peer)
        if stream is not None:
            try:
                return self._streams.send(stream, frames, track, block)
            except OSError:
                pass  # it broke (and is dropped): this message and the later ones go through ZeroMQ
        entry = self._dealers.get(peer)
        if entry is None:
            self._check_open()
            raise TransportError(f"no connection to peer {peer.decode(errors='replace')}")
        sock, lock = entry
        flags = 0 if block else _NOBLOCK
        joined = join_frames(frames) if not track and len(frames) > 1 else None  # outside the lock
        with lock:
            if self._closed:
                raise ClosedError("the transport was closed")
            try:
                if track:
                    parts = [zmq.Frame(f, track=True) if not isinstance(f, bytes) else f for f in frames]
                    sock.send_multipart(parts, flags=flags, copy=False)
                    trackers = [p.tracker for p in parts if isinstance(p, zmq.Frame)]
                    return zmq.MessageTracker(*trackers) if trackers else None
                if joined is not None:
                    sock.send(joined, flags)  # copied: cheaper than a zero-copy frame when small
                    return None
                last = len(frames) - 1
                # frame by frame with int flags: pyzmq's send_multipart costs twice as much per small
                # message (flag enums); big frames still go without a copy
                send = sock.send
                for i, frame in enumerate(frames):
                    send(frame, flags | _SNDMORE if i < last else flags, copy=False)
                return None
            except zmq.Again as exc:
                raise WouldBlock(f"the queue to {peer.decode(errors='replace')} is full") from exc
            except zmq.ZMQError as exc:
                if self._closed or exc.errno == zmq.ETERM:
                    raise ClosedError("the transport was closed") from exc
                raise TransportError(f"send to {peer.decode(errors='replace')} failed: {exc}") from exc

    def refused(self, peer: bytes) -> str | None:
        """Why ``peer`` (connected with ``watch=True``) refused this node's handshake, if it did; once
        a handshake succeeded the peer is no longer watched."""
        monitor = self._monitors.get(peer)
        if monitor is None:
            return None
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return None
            except zmq.ZMQError:
                return None
            kind = int(event["event"])
            if kind == int(zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self._unwatch(peer)
                return None
            if kind in _HANDSHAKE_EVENTS:
                return _HANDSHAKE_EVENTS[kind]

    def watch_liveness(self, peer: bytes) -> None:
        entry = self._dealers.get(peer)
        if entry is None or peer in self._liveness:
            return
        self._unwatch(peer)  # a socket has one monitor: the handshake's (``refused``) is done with by now
        # an address of its own: the handshake monitor's (pyzmq's per-socket name) may not be released yet
        address = f"inproc://pslaunch-liveness-{os.getpid()}-{next(_MONITOR_IDS)}"
        with entry[1]:
            entry[0].monitor(address, int(zmq.EVENT_DISCONNECTED) | int(zmq.EVENT_CONNECTED))
        monitor = self._context.socket(zmq.PAIR)
        monitor.connect(address)
        self._liveness[peer] = monitor

    def _read_liveness(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        now = time.monotonic()
        for peer, monitor in list(self._liveness.items()):
            while True:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.ZMQError:  # zmq.Again too: nothing more now
                    break
                if int(event["event"]) == int(zmq.EVENT_DISCONNECTED):
                    self._down_since.setdefault(peer, now)
                    self._ended.add(peer)
                else:  # connected again: a blip, not an end
                    self._down_since.pop(peer, None)

    def down(self) -> set[bytes]:
        self._read_liveness()
        return set(self._down_since)

    def dropped(self, peer: bytes) -> bool:
        self._read_liveness()
        if peer in self._ended:
            self._ended.discard(peer)
            return True
        return False

    def gone(self, grace: float) -> list[bytes]:
        self._read_liveness()
        now = time.monotonic()
        lost = [peer for peer, since in self._down_since.items() if now - since >= grace]
        for peer in lost:
            self._down_since.pop(peer, None)
            self._stop_liveness(peer)
        return lost

    def _stop_liveness(self, peer: bytes) -> None:
        self._drop_monitor(self._liveness, peer)

    # ---- streams ---------------------------------------------------------------------------------------
    def adopt_stream(self, peer: bytes, sock: Any) -> None:
        """Carry every message to and from ``peer`` on ``sock`` from now on (a connection whose handshake
        is done: ``psnode.transport.streams``); a stream the peer had before is closed (any thread).
        After ``close`` the socket is closed instead."""
        self._streams.adopt(peer, sock)

    @property
    def streams(self) -> dict[bytes, Stream]:
        """The streams in use, by peer (a copy)."""
        return self._streams.by_peer()

    def _items(self) -> list:
        """What poll waits on: the ROUTER, the wake eventfd, each stream."""
        self._poll_items = [(self._require_router(), _POLLIN), (self._wake_fd, _POLLIN), *self._streams.poll_items()]
        return self._poll_items

    def disconnect(self, peer: bytes) -> None:
        stream = self._streams.get(peer)
        if stream is not None:
            self._streams.drop(stream, f"the stream to {peer.decode(errors='replace')} is closed: the peer is lost")
        self._stop_liveness(peer)
        self._down_since.pop(peer, None)
        self._unwatch(peer)
        with self._connect_lock:
            entry = self._dealers.pop(peer, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(0)

    def _unwatch(self, peer: bytes) -> None:
        self._drop_monitor(self._monitors, peer)

    def _drop_monitor(self, monitors: dict[bytes, zmq.Socket], peer: bytes) -> None:
        """Stop the monitor of ``peer``'s connection kept in ``monitors`` (handshake or liveness)."""
        monitor = monitors.pop(peer, None)
        if monitor is None:
            return
        entry = self._dealers.get(peer)
        if entry is not None:
            try:
                entry[0].disable_monitor()
            except zmq.ZMQError:
                pass
        monitor.close(0)

    def poll(self, timeout: float) -> bool:
        router = self._require_router()
        if self._inbox:
            return True
        items = self._items() if self._streams.stale or self._poll_items is None else self._poll_items
        try:
            events = zmq.zmq_poll(items, max(0, int(timeout * 1000)))
        except zmq.ZMQError as exc:
            if self._closed:
                raise ClosedError("the transport was closed") from exc
            raise TransportError(f"poll failed: {exc}") from exc
        ready = False
        for what, mask in events:
            if what is router:
                ready = True
            elif what == self._wake_fd:  # woken: clear the eventfd so the next poll waits again
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
            else:
                self._streams.ready(what, mask, self._inbox)
        return ready or bool(self._inbox)

    def wake(self) -> None:
        with self._wake_lock:
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)

    def inject(self, sender: bytes, frames: list) -> None:
        """Hand in a message from ``sender`` that came another way; ``recv`` returns it next (any
        thread). Waits while ``_INBOX_MAX`` such messages are not received yet: the other way's reader
        stops reading, and its sender feels it, as a ZeroMQ peer past the high-water mark does."""
        with self._inbox_room:
            while len(self._inbox) >= _INBOX_MAX and not self._closed:
                self._inbox_room.wait(0.1)
            self._inbox.append((sender, frames))
        self.wake()

    def recv(self) -> tuple[bytes, list[Any]]:
        if self._inbox:
            with self._inbox_room:
                self._inbox_room.notify()
                return self._inbox.popleft()
        router = self._require_router()
        recv = router.recv
        try:
            sender = recv(_NOBLOCK)  # the ROUTER's identity frame; at least one frame follows it
            frame = recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:  # the frame says whether more follow: no socket option call per frame
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
            if len(frames) == 1:
                view = frame.buffer
                if view[:1] == b"\x00":
                    frames = split_frames(view) or frames
        except zmq.ZMQError as exc:
            if self._closed:
                raise ClosedError("the transport was closed") from exc
            raise TransportError(f"receive failed: {exc}") from exc
        return sender, frames

    def close(self, linger: float = 0.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._streams.close(linger)  # what they queued gets the linger too
        for peer in list(self._monitors):
            self._unwatch(peer)
        for peer in list(self._liveness):
            self._stop_liveness(peer)
        with self._connect_lock:
            dealers = list(self._dealers.values())
            self._dealers.clear()
        for sock, lock in dealers:
            with lock:
                sock.close(int(linger * 1000))
        if self._router is not None:
            self._router.close(0)
            self._router = None
        self._poll_items = None
        if self._zap is not None:
            self._zap.close()
        self._context.term()
        with self._wake_lock:
            os.close(self._wake_fd)
            self._wake_fd = -1

    def _require_router(self) -> zmq.Socket:
        if self._router is None:
            self._check_open()
            raise TransportError("bind() was not called")
        return self._router

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the transport was closed")
