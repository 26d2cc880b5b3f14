"""Data lanes: a job's big pushes and pull replies on plain TCP streams, read where they belong.

**Why.** Over ZeroMQ every big message passes an I/O thread on both sides (one per process, so a
server's single I/O thread reads every worker's pushes one after the other), lands in memory
ZeroMQ allocated for it, and a worker then copies a pull's reply into the caller's ``out``. A
round of ``dist_sync`` over raw pyzmq (both pushes summed, the sum sent back to both) moved 1.6
GB/s per worker at 4 MiB on 2 cores; over plain sockets, each connection read by a thread of its
own into its destination, 2.4 GB/s (docs/benchmarks.md, "Where the time goes"). So a worker sends
a big push, and a server a big pull reply, on a lane (``psnode.transport.lanes``: one TCP
connection per ordered pair of nodes, a thread each side, opened with a proof of the job key).

**Which messages.** A ``PUSH`` of one value in a message of its own (header, record, empty
payload, the value) from a worker to a server, and a ``PULL_REPLY`` of one value (header, record,
empty payload, the value, and the push acknowledgements riding along, if any) from a server to a
worker, whose value has ``LANE_MIN`` bytes or more, to a peer reached over TCP (another host, or
``PSLAUNCH_SAME_HOST=tcp``) that listens for data lanes. Everything else keeps ZeroMQ. A node
routes through ``route``, which the transport asks first for each such message
(``ZmqTransport.lane_router``).

**Order.** Messages of one sender on one lane keep their order, and a lane that fails sends what it
holds through ZeroMQ before anything later (``Lanes(in_order=True)``). Across the two ways there is
no order, and the data path needs none: a pull names how many pushes it must include and waits for
them. Jobs that rely on more are left on ZeroMQ (``wanted``): server replicas (a ``SEAM`` marks a
place in a worker's stream), workers replaced in place (a replacement's marks and redone pushes)
and elastic jobs (a worker leaves after its last push).

**Wire.** A prefix of ``PREFIX`` bytes: u64 value bytes, u16 frames before the value (3), u16
frames after it (0 or 1), u16 bytes of those frames, u16 zero; a u32 length per frame; the frames'
bytes; zeros. The value follows. The prefix is checked before a byte of the value is read (its
size within the node's frame limit, a header of a command this side takes on a lane); the message
then goes where a ZeroMQ message goes (``ZmqTransport.inject``) and is checked as any other. A
worker reads a reply's value straight into the out of the pull it answers (``find_out``), when that
pull waits for it and the sizes agree; a server reads a push into memory of its own per message.
Whatever a lane refuses closes it and is counted as a malformed message of its sender.

Thread-safety: ``route`` runs on any sending thread, the receiving side on each lane's thread.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Callable

import numpy as np

from psnode.errors import ProtocolError, WouldBlock
from psnode.log import logger
from psnode.node.membership import Membership, PeerInfo, endpoint_of
from psnode.node.protocol import (
    FLAG_ACKS,
    FLAG_ERROR,
    FLAG_MIRROR,
    FLAG_OFFER,
    FLAG_PULL,
    Cmd,
    peek,
    unpack_entries,
    unpack_header,
)
from psnode.transport.base import Frame, send_while_full
from psnode.transport.lanes import Lanes

__all__ = ["DataLanes", "LANE_MIN", "PREFIX", "wanted", "needs_one_way", "pack_prefix"]

LANE_MIN = 256 << 10
"""The smallest value that travels on a lane: below it a message costs ZeroMQ little, and a lane's
hand-off between threads would cost more than it saves."""

PREFIX = 256
RESEND_WAIT = 60.0  # seconds a message a failed lane gave back may wait for its peer's full ZeroMQ queue
_FIXED = struct.Struct("<QHHHH")
_BEFORE = 3  # header, record(s), payload
_TAKES = {"server": Cmd.PUSH, "worker": Cmd.PULL_REPLY}  # what each role takes on its data lanes
_NOT_ON_LANES = FLAG_PULL | FLAG_OFFER | FLAG_MIRROR  # pushes that carry a pull, wait for an invitation, or copy


def wanted(env: Any, role: str) -> bool:
    """Whether a node of ``role`` in the job ``env`` describes uses data lanes (see the module
    docstring): a worker or server over ZeroMQ, lanes on (``PSLAUNCH_LANES``), connections not
    encrypted (a lane's bytes are in the clear), a peer that may be reached over TCP (not a job
    on one host with the same-host path), and a job that needs no order across the two ways."""
    return (role in _TAKES and env.lanes and not env.encrypt and env.transport == "zmq"
            and not (env.local and env.same_host != "tcp") and not needs_one_way(env))


def needs_one_way(env: Any) -> bool:
    """Whether the job ``env`` describes relies on the order of a worker's messages to a server
    beyond what one way keeps: server replicas (a ``SEAM`` marks a place in a worker's stream),
    workers replaced in place (a replacement's marks and redone pushes) and elastic jobs (a worker
    leaves after its last push). Such jobs send those messages through ZeroMQ alone."""
    return bool(env.server_replicas) or env.restart_scope != "job" or env.elastic


def pack_prefix(frames: list, nbytes: int) -> bytes | None:
    """The prefix of a message whose value, of ``nbytes``, is ``frames[3]``; None when its other
    frames are not all bytes or do not fit."""
    small = frames[:_BEFORE] + frames[_BEFORE + 1:]
    if any(type(f) is not bytes for f in small):
        return None
    meta = b"".join(small)
    head = _FIXED.pack(nbytes, _BEFORE, len(small) - _BEFORE, len(meta), 0) + struct.pack(
        f"<{len(small)}I", *[len(f) for f in small])
    if len(head) + len(meta) > PREFIX:
        return None
    return (head + meta).ljust(PREFIX, b"\0")


def _unpack_prefix(prefix: bytes, limit: int) -> tuple[int, list[bytes], list[bytes]]:
    """``(value bytes, frames before, frames after)`` of a prefix.

    Raises:
        ProtocolError: a prefix ``pack_prefix`` does not make, or a value over ``limit`` bytes.
    """
    nbytes, before, after, meta, spare = _FIXED.unpack_from(prefix)
    if before != _BEFORE or after > 1 or spare:
        raise ProtocolError(f"a data lane prefix of {before} frames before the value and {after} after")
    count = before + after
    start = _FIXED.size + 4 * count
    lengths = struct.unpack_from(f"<{count}I", prefix, _FIXED.size)
    if sum(lengths) != meta or start + meta > PREFIX:
        raise ProtocolError(f"a data lane prefix whose frames of {list(lengths)} bytes do not fit its {PREFIX}")
    if not LANE_MIN <= nbytes <= limit:
        raise ProtocolError(f"a data lane message with a value of {nbytes} bytes ({LANE_MIN} to {limit})")
    frames = []
    for length in lengths:
        frames.append(prefix[start:start + length])
        start += length
    return nbytes, frames[:before], frames[before:]


class DataLanes:
    """One node's data lanes (see the module docstring).

    ``lanes``: its listening ``Lanes``; ``transport``: the ZeroMQ transport (messages go there when a
    lane does not take them, and come in through its ``inject``); ``members``: the address book;
    ``me``: this node; ``same_host``: ``PSLAUNCH_SAME_HOST``; ``limit``: the largest value taken;
    ``note_malformed(sender, error)``: counts what a lane refused. A worker sets ``find_out(req_id,
    index, nbytes, server)``: the writable bytes a reply's value may be read into, or None.
    """

    prefix_size = PREFIX

    def __init__(self, lanes: Lanes, transport: Any, members: Membership, me: PeerInfo, same_host: str, limit: int,
                 note_malformed: Callable[[bytes, BaseException], None]) -> None:
        self.lanes = lanes
        self.transport = transport
        self.members = members
        self.me = me
        self.same_host = same_host
        self.limit = limit
        self.note_malformed = note_malformed
        self.find_out: Callable[[int, int, int, int], Any] | None = None
        self.takes = int(_TAKES[me.role])
        self._addresses: dict[bytes, Any] = {}  # peer uid -> (host, port, describe), or False: ZeroMQ only
        self._count_lock = threading.Lock()
        self.sent = 0  # messages handed to lanes
        self.written_through = 0  # of those, written on the sender's thread from its own buffers
        self.received = 0  # messages taken from lanes
        self.in_place = 0  # of those, values read straight into a pull's out

    def start(self) -> None:
        """Accept the peers' lanes and offer the transport the messages that may take one."""
        self.lanes.serve(self, self._known)
        self.transport.lane_router = self

    def _known(self, uid: bytes) -> PeerInfo | None:
        peer = self.members.peers.get(uid)
        # a server takes lanes from workers, a worker from servers
        return peer if peer is not None and peer.role != self.me.role and peer.role in _TAKES else None

    # ---- sending (any thread) --------------------------------------------------------------------
    def route(self, peer: bytes, frames: list) -> Any:
        """Queue ``frames`` for ``peer`` on its lane when the module docstring says they go there: a
        tracker (done once written), else None (send them through ZeroMQ)."""
        address = self._addresses.get(peer)
        if address is None:
            address = self._address_of(peer)
        prefix = self._prefix(frames) if address else None
        if prefix is None:
            return None
        tracker = self.lanes.send(peer, address[:2], address[2], [prefix, frames[3]],
                                  lambda again: self._send_back(peer, self._frames_of(again)))
        if tracker is not None:
            self._count_sent()
        return tracker

    def write_through(self, peer: bytes, frames: list) -> Any:
        """Write ``frames`` for ``peer`` on its lane from this thread (``Lanes.write_through``) when
        they go on a lane, the lane is open and idle and its socket takes them: a tracker (the frames
        may change as soon as this returns), else None (nothing was written; send a copy)."""
        address = self._addresses.get(peer)
        prefix = self._prefix(frames) if address else None
        if prefix is None:
            return None
        tracker = self.lanes.write_through(peer, [prefix, frames[3]])
        if tracker is not None:
            self._count_sent(through=True)
        return tracker

    def _prefix(self, frames: list) -> bytes | None:
        """The lane prefix of ``frames`` when they are a message that goes on a lane, else None."""
        cmd, flags = peek(frames[0])
        if cmd == Cmd.PUSH:
            if len(frames) != 4 or flags & _NOT_ON_LANES:
                return None
        elif cmd != Cmd.PULL_REPLY or flags & FLAG_ERROR or len(frames) != 4 + bool(flags & FLAG_ACKS):
            return None
        view = memoryview(frames[3])  # its bytes, whatever holds them (an array, a memoryview, bytes)
        nbytes = view.nbytes
        if nbytes < LANE_MIN or len(frames[2]) or not view.c_contiguous:
            return None
        return pack_prefix(frames, nbytes)

    def _count_sent(self, through: bool = False) -> None:
        with self._count_lock:
            self.sent += 1
            self.written_through += through

    def _frames_of(self, buffers: list) -> list:
        """The message a lane gave back (its prefix and value) as the frames it was made of (the
        lane's fallback is the one it was opened with, so it cannot hold a message's own frames)."""
        _, before, after = _unpack_prefix(bytes(buffers[0]), self.limit)
        return [*before, buffers[1], *after]

    def _send_back(self, peer: bytes, frames: list) -> None:
        """Send through ZeroMQ a message a failed lane gave back (on that lane's thread, while later
        messages wait: see ``Lanes(in_order=True)``). It waits while the peer's queue is full, but no
        longer than ``RESEND_WAIT`` and not once the peer left the book: a peer that died takes
        nothing, and the job hears of its death from the scheduler.

        Raises:
            PSNodeError: the send failed (the lane logs it).
        """
        try:
            send_while_full(lambda: self.transport.send_here(peer, frames, block=False), RESEND_WAIT,
                            lambda: peer in self.members.peers)
        except WouldBlock:
            logger.warning("a message of a failed data lane to %s was not sent: its queue stayed full",
                           peer.decode(errors="replace"))

    def _address_of(self, uid: bytes) -> Any:
        peer = self.members.peers.get(uid)
        if peer is None:
            return False  # not in the book (yet): ZeroMQ, and asked again next time
        address: Any = False
        if peer.data_port and peer.role != self.me.role and peer.role in _TAKES:
            endpoint = endpoint_of(peer, self.transport, self.me.fingerprint, self.same_host)
            if endpoint.startswith("tcp://"):
                address = (peer.host, peer.data_port, peer.describe())
        self._addresses[uid] = address
        return address

    # ---- receiving (each lane's thread) ----------------------------------------------------------
    def parse(self, peer: PeerInfo, prefix: bytes) -> tuple[int, tuple[list, list]]:
        """Value bytes after ``prefix``, and the frames around the value.

        Raises:
            ProtocolError: a prefix no data lane sends here (the message names what).
        """
        nbytes, before, after = _unpack_prefix(prefix, self.limit)
        cmd, flags, _, _ = unpack_header(before[0])
        if cmd != self.takes:
            raise ProtocolError(f"a data lane message {Cmd(cmd).name}; a {self.me.role} takes only "
                                f"{Cmd(self.takes).name} on its lanes")
        if len(after) != bool(flags & FLAG_ACKS):
            raise ProtocolError(f"a data lane message with {len(after)} frames after its value and flags {flags}")
        return nbytes, (before, after)

    def destination(self, peer: PeerInfo, message: tuple[list, list], size: int) -> Any:
        """A pull reply's value: the out of the pull it answers, when ``find_out`` gives it; else memory of its own."""
        find_out = self.find_out
        if find_out is not None:
            before = message[0]
            try:
                entries = unpack_entries(before[1])
            except ProtocolError:
                entries = []
            if len(entries) == 1 and entries[0][2] == 1 and entries[0][4] == 0 and entries[0][5] == size:
                _, _, req_id, _ = unpack_header(before[0])
                out = find_out(req_id, entries[0][1], size, peer.rank)
                if out is not None:
                    return out
        return np.empty(size, dtype=np.uint8)  # not zeroed: every byte is read into it

    def deliver(self, peer: PeerInfo, message: tuple[list, list], body: Any) -> None:
        """Hand the message to the node as one from ZeroMQ (the value's frame is ``body`` itself)."""
        before, after = message
        frames = [Frame(memoryview(f)) for f in before]
        frames.append(Frame(body if isinstance(body, memoryview) else memoryview(body)))
        frames.extend(Frame(memoryview(f)) for f in after)
        with self._count_lock:
            self.received += 1
            if isinstance(body, memoryview):
                self.in_place += 1
        self.transport.inject(peer.uid.encode(), frames)

    def refused(self, peer: PeerInfo, prefix: bytes, why: str) -> None:
        """The lane from ``peer`` sent what no data lane sends: count it as a malformed message."""
        self.note_malformed(peer.uid.encode(), ProtocolError(f"{why} (on its data lane, which this node closed)"))
