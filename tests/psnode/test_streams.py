"""Streams (psnode.transport.streams): a worker's one connection to a server (TCP, or the server's
Unix socket on one host), read and written by the nodes' own threads. Real sockets on 127.0.0.1
and Unix sockets within one process: the wire (frames of every kind, a message in many reads, a big
one in memory of its own), a sender faster than its reader (queued, tracked, written by whoever
polls, a blocking sender draining it, a non-blocking one told WouldBlock), hostile bytes refused
naming what is wrong, the lanes' handshake with its last word over TCP and a Unix socket, a
worker that falls back to TCP, the address book's socket names, and two ``ZmqTransport``s that
carry a peer's messages on its stream and fall back to ZeroMQ."""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque

import numpy as np
import pytest

from psnode.errors import ProtocolError, WouldBlock
from psnode.transport import streams
from psnode.transport.lane_wire import connect_lane
from psnode.transport.lanes import Lanes
from psnode.transport.streams import MAGIC, MAX_FRAMES, Stream, pack_header
from psnode.transport.zeromq import ZmqTransport

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
JOB = b"job-streams"


@pytest.fixture(params=["tcp", "unix"])
def pair(request):
    """Two connected sockets, TCP on 127.0.0.1 or a Unix socket pair: (the sender's, the reader's)."""
    if request.param == "unix":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        listener.close()
    yield a, b
    a.close()
    b.close()


def read_until(reader: Stream, count: int, inbox: deque | None = None, timeout: float = 10.0,
               writer: Stream | None = None) -> deque:
    """Poll ``reader`` (and flush ``writer``) until ``inbox`` holds ``count`` messages."""
    inbox = deque() if inbox is None else inbox
    deadline = time.monotonic() + timeout
    while len(inbox) < count:
        assert time.monotonic() < deadline, f"{len(inbox)} of {count} messages within {timeout} s"
        select.select([reader.sock], [], [], 0.05)
        reader.read(inbox)
        if writer is not None and writer.queued:
            writer.flush()
    return inbox


def frames_of(message) -> list[bytes]:
    peer, frames = message
    assert peer == b"worker@a"
    return [f.bytes for f in frames]


def test_messages_of_every_kind_of_frame_arrive_whole_in_order(pair):
    a, b = pair
    sender, reader = Stream(b"server@b", a, 1 << 30), Stream(b"worker@a", b, 1 << 30)
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)  # over the receive buffer
    sent = [[b"head", b"", b"x" * 100], [arr], [memoryview(b"view")], [b"a"] * MAX_FRAMES, [b"h", big, b"t"], []]
    for frames in sent:
        assert sender.send(frames, track=False, block=True) is None
    inbox = read_until(reader, len(sent), writer=sender)
    got = [frames_of(m) for m in inbox]
    assert got[0] == [b"head", b"", b"x" * 100]
    assert got[1] == [arr.tobytes()]
    assert got[2] == [b"view"]
    assert got[3] == [b"a"] * MAX_FRAMES
    assert got[4] == [b"h", big.tobytes(), b"t"]
    assert got[5] == []
    assert (sender.sent, reader.received) == (len(sent), len(sent))


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)  # Nagle's algorithm is TCP's
def test_a_stream_sends_a_small_message_at_once_not_held_for_the_last_ones_ack(pair):
    a, b = pair
    assert not a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # a plain TCP socket: Nagle on
    Stream(b"server@b", a, 1 << 20)
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # Nagle off: a reply is not held up to 40 ms


def test_a_message_that_comes_a_byte_at_a_time_is_taken_once_whole(pair):
    a, b = pair
    # room for a thousand one-byte sends between reads (a Unix socket keeps each as a buffer of its own)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    reader = Stream(b"worker@a", b, 1 << 20)
    frames = [b"PS-header", b"record" * 10, b"value" * 2000]  # 10 KiB: the receive buffer's path
    wire = pack_header([len(f) for f in frames]) + b"".join(frames)
    inbox: deque = deque()
    for i in range(len(wire) - 1):
        a.sendall(wire[i:i + 1])
        if i % 997 == 0:
            select.select([b], [], [], 1.0)
            reader.read(inbox)
            assert not inbox  # a part of a message is kept, not taken
    a.sendall(wire[-1:])
    read_until(reader, 1, inbox)
    assert frames_of(inbox[0]) == frames
    big = [b"h", os.urandom(200_000)]  # a big one in pieces: read into memory of its own
    wire = pack_header([len(f) for f in big]) + b"".join(big)
    for start in range(0, len(wire), 50_000):
        a.sendall(wire[start:start + 50_000])
        select.select([b], [], [], 1.0)  # whatever of it arrived: the message grows by parts
        reader.read(inbox)
    read_until(reader, 2, inbox)
    assert frames_of(inbox[1]) == big


def test_a_sender_faster_than_its_reader_queues_tracks_and_whoever_polls_writes_the_rest(pair):
    a, b = pair
    sender, reader = Stream(b"server@b", a, 1 << 30), Stream(b"worker@a", b, 1 << 30)
    value = np.ones(16 << 20, np.uint8)  # more than both kernel buffers hold
    tracker = sender.send([b"first", value], track=True, block=False)
    assert sender.queued > 0 and not tracker.done  # the kernel took part of it; the rest waits, in order
    small = sender.send([b"second"], track=True, block=False)
    assert not small.done
    inbox = read_until(reader, 2, writer=sender)
    assert tracker.done and small.done and sender.queued == 0
    assert [f[:6] for f in (frames_of(inbox[0])[0], frames_of(inbox[1])[0])] == [b"first", b"second"]
    assert frames_of(inbox[0])[1] == value.tobytes()


def test_over_the_queue_limit_a_non_blocking_send_is_told_and_a_blocking_one_drains_the_queue(pair, monkeypatch):
    monkeypatch.setattr(streams, "QUEUE_MAX", 1 << 20)
    a, b = pair
    sender, reader = Stream(b"server@b", a, 1 << 30), Stream(b"worker@a", b, 1 << 30)
    value = np.zeros(12 << 20, np.uint8)
    sender.send([value], track=False, block=False)
    assert sender.queued > streams.QUEUE_MAX
    with pytest.raises(WouldBlock, match="holds"):
        sender.send([b"more"], track=False, block=False)
    inbox: deque = deque()
    stop = threading.Event()

    def read() -> None:  # the peer reads meanwhile, as a live node does
        while not stop.is_set():
            select.select([b], [], [], 0.05)
            reader.read(inbox)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        sender.send([b"blocking"], track=False, block=True)  # writes the queue down itself first
        assert sender.queued <= streams.QUEUE_MAX + 100
        sender.send([b"last"], track=False, block=True)
        deadline = time.monotonic() + 10
        while len(inbox) < 3 and time.monotonic() < deadline:
            select.select([], [a], [], 0.05)  # the socket takes more: write what is queued, as a poll would
            sender.flush()
    finally:
        stop.set()
        thread.join()
    assert [frames_of(m)[0][:8] for m in inbox][1:] == [b"blocking", b"last"]


@pytest.mark.parametrize("wire, why", [
    (struct.pack("<QH", 2 + 8 * 65, 65), "65 frames"),
    (struct.pack("<QH", 1, 2), "2 frames and 1 bytes"),
    (struct.pack("<QHQQ", 2 + 16 + 5, 2, 2, 2), r"frames of \[2, 2\] bytes do not make its 5"),
    (struct.pack("<QHQ", 2 + 8 + 5000, 1, 5000), r"frames of \[5000\] bytes, over this node's limit of 4096"),
], ids=["too-many-frames", "size-short-of-its-lengths", "lengths-disagree", "frame-over-the-limit"])
def test_hostile_bytes_are_refused_naming_what_is_wrong_before_a_byte_is_kept(pair, wire, why):
    a, b = pair
    reader = Stream(b"worker@a", b, 4096)
    a.sendall(wire + b"\0" * 64)
    select.select([b], [], [], 1.0)
    inbox: deque = deque()
    with pytest.raises(ProtocolError, match=why):
        reader.read(inbox)
    assert not inbox


def test_the_peers_end_is_an_eof_and_a_closed_stream_takes_nothing(pair):
    a, b = pair
    sender, reader = Stream(b"server@b", a, 1 << 30), Stream(b"worker@a", b, 1 << 30)
    tracker = sender.send([np.zeros(12 << 20, np.uint8)], track=True, block=False)  # more than the kernel holds
    sender.close()
    assert tracker.done  # given up, not left waiting
    with pytest.raises(OSError, match="closed"):
        sender.send([b"late"], track=False, block=True)
    with pytest.raises(EOFError, match="closed the stream"):
        while True:
            select.select([b], [], [], 1.0)
            reader.read(deque())


class Adopter:
    """What a server's stream listener hands each connection to once its handshake is done."""

    def __init__(self) -> None:
        self.adopted: list = []
        self.taken = threading.Event()

    def adopt(self, peer, sock) -> None:
        self.adopted.append((peer, sock))
        self.taken.set()


def test_the_handshake_takes_only_a_holder_of_the_key_and_ends_with_the_acceptors_word():
    adopter = Adopter()
    adopted, taken = adopter.adopted, adopter.taken
    lanes = Lanes.listen("127.0.0.1", b"server@b", JOB.decode(), KEY, what="workers' streams", magic=MAGIC)
    lanes.serve(adopter, lambda uid: "worker a" if uid == b"worker@a" else None)
    try:
        sock = connect_lane(("127.0.0.1", lanes.port), MAGIC, KEY, JOB, b"worker@a", b"server@b")
        assert taken.wait(5) and adopted[0][0] == "worker a"  # after the server's last word: it may come later
        sock.sendall(b"ping")
        assert adopted[0][1].recv(4) == b"ping"  # the acceptor's socket is the opener's connection
        sock.close()
        with pytest.raises(ProtocolError, match="did not prove"):
            connect_lane(("127.0.0.1", lanes.port), MAGIC, b"another key".ljust(32), JOB, b"worker@a", b"server@b")
        with pytest.raises((EOFError, OSError)):  # a lane's handshake on a stream port: closed, never taken
            connect_lane(("127.0.0.1", lanes.port), b"PSLANE\x01\x00", KEY, JOB, b"worker@a", b"server@b")
        assert len(adopted) == 1
    finally:
        lanes.close()
        for _, s in adopted:
            s.close()


@pytest.fixture
def transports():
    """A worker's and a server's ZmqTransport connected both ways over ZeroMQ, with a stream between them."""
    worker, server = ZmqTransport(b"worker@a"), ZmqTransport(b"server@b")
    worker_port, server_port = worker.bind(0, host="127.0.0.1"), server.bind(0, host="127.0.0.1")
    worker.connect(b"server@b", f"tcp://127.0.0.1:{server_port}")
    server.connect(b"worker@a", f"tcp://127.0.0.1:{worker_port}")
    listener = socket.create_server(("127.0.0.1", 0))
    opened = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    listener.close()
    worker.adopt_stream(b"server@b", opened)
    server.adopt_stream(b"worker@a", accepted)
    yield worker, server
    worker.close()
    server.close()


def receive(transport: ZmqTransport, count: int, timeout: float = 10.0) -> list:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} messages within {timeout} s"
        if transport.poll(0.05):
            sender, frames = transport.recv()
            got.append((sender, [f.bytes for f in frames]))
    return got


def test_a_transport_carries_its_peers_messages_on_the_stream_both_ways(transports):
    worker, server = transports
    value = np.arange(300_000, dtype=np.float32)  # over the receive buffer and the kernel's first take
    worker.send(b"server@b", [b"PS-push", b"rec", value])
    worker.send(b"server@b", [b"PS-pull"])
    got = receive(server, 2)
    assert got == [(b"worker@a", [b"PS-push", b"rec", value.tobytes()]), (b"worker@a", [b"PS-pull"])]
    tracker = server.send(b"worker@a", [b"PS-reply", value], track=True)
    assert receive(worker, 1) == [(b"server@b", [b"PS-reply", value.tobytes()])]
    tracker.wait(5)
    assert worker.streams[b"server@b"].sent == 2 and server.streams[b"worker@a"].sent == 1


def test_a_stream_whose_bytes_do_not_parse_is_closed_said_and_zeromq_carries_the_pairs_messages(transports):
    worker, server = transports
    refused = []
    server.stream_refused = lambda peer, why: refused.append((peer, why))
    worker.streams[b"server@b"].sock.sendall(struct.pack("<QH", 2 + 8 * 99, 99))  # not a message a stream sends
    deadline = time.monotonic() + 5
    while not refused and time.monotonic() < deadline:
        server.poll(0.05)
    assert refused and refused[0][0] == b"worker@a" and "99 frames" in refused[0][1], refused
    assert b"worker@a" not in server.streams
    server.send(b"worker@a", [b"PS-after"])  # through ZeroMQ now
    assert receive(worker, 1) == [(b"server@b", [b"PS-after"])]
    deadline = time.monotonic() + 5
    while b"server@b" in worker.streams and time.monotonic() < deadline:
        worker.poll(0.05)  # the worker reads the stream's end, and drops it too
    assert b"server@b" not in worker.streams
    worker.send(b"server@b", [b"PS-back"])
    assert receive(server, 1) == [(b"worker@a", [b"PS-back"])]


def test_closing_a_stream_frees_a_sender_that_waits_for_a_peer_that_reads_nothing(pair, monkeypatch):
    monkeypatch.setattr(streams, "QUEUE_MAX", 1 << 20)
    a, _ = pair
    sender = Stream(b"server@b", a, 1 << 30)
    sender.send([np.zeros(12 << 20, np.uint8)], track=False, block=False)  # more than the kernel holds
    failed = []

    def blocking_send() -> None:
        try:
            sender.send([b"waits"], track=False, block=True)  # writes the queue down first: never, here
        except OSError as exc:
            failed.append(exc)

    waiting = threading.Event()
    drain = sender._drain

    def drain_and_say(below: int) -> None:  # the send waits here, holding the stream's lock
        waiting.set()
        drain(below)

    sender._drain = drain_and_say
    thread = threading.Thread(target=blocking_send)
    thread.start()
    assert waiting.wait(5), "the blocking send did not start waiting"
    started = time.monotonic()
    sender.close()
    thread.join(5)
    assert not thread.is_alive() and failed, "the blocked sender was left waiting"
    assert time.monotonic() - started < 3


def test_a_worker_tries_again_when_a_server_busy_with_other_handshakes_closes_its_connection(monkeypatch):
    monkeypatch.setattr("psnode.transport.lanes.MAX_HANDSHAKES", 1)
    adopter = Adopter()  # takes a connection after the server's last word: the worker may have its socket first
    adopted, taken = adopter.adopted, adopter.taken

    class Refusals(logging.Handler):  # the server says when it turns a connection away
        def __init__(self) -> None:
            super().__init__()
            self.seen = threading.Event()

        def emit(self, record: logging.LogRecord) -> None:
            if "handshakes are already under way" in record.getMessage():
                self.seen.set()

    refusals = Refusals()
    logging.getLogger("psnode").addHandler(refusals)
    lanes = Lanes.listen("127.0.0.1", b"server@b", JOB.decode(), KEY, what="workers' streams", magic=MAGIC)
    lanes.serve(adopter, lambda uid: "worker a")
    stalled = socket.create_connection(("127.0.0.1", lanes.port))  # a handshake under way that says nothing

    def free_the_slot() -> None:  # once the server turned the worker's first try away
        refusals.seen.wait(10)
        stalled.close()

    thread = threading.Thread(target=free_the_slot)
    thread.start()
    try:
        sock = streams.connect_stream(("127.0.0.1", lanes.port), KEY, JOB, b"worker@a", b"server@b", tries=3)
        sock.close()
        assert refusals.seen.is_set()  # the first try was turned away; a later one got through
        assert taken.wait(5) and len(adopted) == 1
    finally:
        thread.join()
        logging.getLogger("psnode").removeHandler(refusals)
        lanes.close()
        for _, s in adopted:
            s.close()


def test_a_stream_opens_on_a_servers_unix_socket_with_the_same_proof_and_its_name_is_the_servers_alone():
    name = f"pslaunch-streams-test-{os.getpid()}-{os.urandom(3).hex()}"
    adopter = Adopter()
    lanes = Lanes.listen_local(name, b"server@b", JOB.decode(), KEY, what="workers' streams", magic=MAGIC)
    lanes.serve(adopter, lambda uid: "worker a" if uid == b"worker@a" else None)
    try:
        assert lanes.port == 0  # no TCP port: the address book names the socket
        sock = streams.connect_stream("\0" + name, KEY, JOB, b"worker@a", b"server@b")
        assert sock.family == socket.AF_UNIX
        assert adopter.taken.wait(5) and adopter.adopted[0][0] == "worker a"
        sock.sendall(b"ping")
        assert adopter.adopted[0][1].recv(4) == b"ping"
        sock.close()
        with pytest.raises(ProtocolError, match="did not prove"):
            streams.connect_stream("\0" + name, b"another key".ljust(32), JOB, b"worker@a", b"server@b")
        with pytest.raises(OSError):  # a second listener cannot take the name
            Lanes.listen_local(name, b"server@c", JOB.decode(), KEY, what="workers' streams", magic=MAGIC)
        assert len(adopter.adopted) == 1
    finally:
        lanes.close()
        for _, s in adopter.adopted:
            s.close()
    with pytest.raises(OSError):  # closed: the name is gone with the socket
        streams.connect_stream("\0" + name, KEY, JOB, b"worker@a", b"server@b", tries=1)


def test_a_worker_whose_server_has_no_unix_socket_by_that_name_opens_its_stream_over_tcp(caplog):
    from types import SimpleNamespace

    from psnode.node.connection import Connection
    from psnode.node.membership import PeerInfo, host_fingerprint
    from psnode.transport.security import Security

    security = Security("auth", JOB.decode(), bytes(32))
    adopter = Adopter()
    lanes = Lanes.listen("127.0.0.1", b"server@b", JOB.decode(), security.lane_key(), what="workers' streams",
                         magic=MAGIC)
    lanes.serve(adopter, lambda uid: "worker a")
    here = host_fingerprint()  # the server shares the worker's host: its Unix socket is tried first
    server = PeerInfo("server", 0, "127.0.0.1", 1, "server@b", here, "s", stream_port=lanes.port,
                      stream_socket=f"pslaunch-streams-nobody-{os.urandom(4).hex()}")
    worker = SimpleNamespace(env=SimpleNamespace(security=lambda: security, job_id=JOB.decode(), same_host="shm"),
                             me=PeerInfo("worker", 0, "127.0.0.1", 2, "worker@a", here, "w"),
                             describe=lambda: "worker 0")
    sock = None
    try:
        with caplog.at_level(logging.INFO, logger="psnode"):
            sock = Connection._open_stream(worker, server)
        assert sock is not None and sock.family == socket.AF_INET
        assert adopter.taken.wait(5)
        assert "no stream to server 0 on 127.0.0.1:1 on its Unix socket" in caplog.text, caplog.text
        assert "trying TCP" in caplog.text
    finally:
        if sock is not None:
            sock.close()
        lanes.close()
        for _, s in adopter.adopted:
            s.close()


@pytest.mark.parametrize("name, why", [("a\nb", "printable"), ("é", "ASCII"), ("x" * 101, "at most 100")])
def test_an_address_book_names_a_stream_socket_only_by_a_short_printable_ascii_name(name, why):
    from psnode.node.membership import PeerInfo

    record = PeerInfo("server", 0, "127.0.0.1", 1, "server@b", "fp", "s", stream_port=5, stream_socket="ok-1").as_record()
    assert PeerInfo.from_record(record).stream_socket == "ok-1"
    assert PeerInfo.from_record({k: v for k, v in record.items() if k != "stream_socket"}).stream_socket == ""
    with pytest.raises(ProtocolError, match="stream socket") as raised:
        PeerInfo.from_record({**record, "stream_socket": name})
    assert why.split()[-1] in str(raised.value)
