"""Lanes (psnode.transport.lanes): real TCP sockets on 127.0.0.1 between two ``Lanes`` of one process, and a
raw socket for what an attacker sends. The reader is a small one of the test's: its prefix is the
body's length and the number of a place to read it into."""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest

from psnode.errors import ProtocolError
from psnode.transport import lanes as lanes_module
from psnode.transport.lanes import MAGIC, Lanes

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
PREFIX = struct.Struct("<II")  # body bytes, place (0: none)
LIMIT = 8 << 20


class Inbox:
    """A lane reader that keeps what it gets."""

    prefix_size = PREFIX.size

    def __init__(self) -> None:
        self.places: dict[int, np.ndarray] = {}
        self.messages: list[tuple[str, int, bytes, bool]] = []
        self.refusals: list[str] = []
        self.changed = threading.Condition()

    def parse(self, peer, prefix: bytes) -> tuple[int, int]:
        size, place = PREFIX.unpack(prefix)
        if size > LIMIT:
            raise ProtocolError(f"a body of {size} bytes (at most {LIMIT})")
        return size, place

    def destination(self, peer, place: int, size: int):
        array = self.places.get(place)
        return array if array is not None and array.nbytes == size else None

    def deliver(self, peer, place: int, body) -> None:
        array = self.places.get(place)
        in_place = array is not None and np.shares_memory(np.frombuffer(body, np.uint8), array)
        with self.changed:
            self.messages.append((peer, place, bytes(body), in_place))
            self.changed.notify_all()

    def refused(self, peer, prefix: bytes, why: str) -> None:
        with self.changed:
            self.refusals.append(why)
            self.changed.notify_all()

    def wait(self, what, timeout: float = 10):
        with self.changed:
            assert self.changed.wait_for(what, timeout), (self.messages, self.refusals)


class Pair:
    """An acceptor ``b`` (``worker@b``) serving ``inbox`` and an opener ``a`` (``worker@a``); with
    ``opener_key`` / ``acceptor_key`` one side holds another key."""

    def __init__(self, opener_key: bytes = KEY, acceptor_key: bytes = KEY, known=("worker@a",)) -> None:
        self.inbox = Inbox()
        self.b = Lanes.listen("127.0.0.1", b"worker@b", "job-1", acceptor_key)
        self.b.serve(self.inbox, lambda uid: uid.decode() if uid.decode() in known else None)
        self.a = Lanes.listen("127.0.0.1", b"worker@a", "job-1", opener_key)
        self.fallback: list[list] = []

    def send(self, body: bytes | np.ndarray, place: int = 0):
        size = body.nbytes if isinstance(body, np.ndarray) else len(body)
        return self.a.send(b"worker@b", ("127.0.0.1", self.b.port), "worker b", [PREFIX.pack(size, place), body],
                           self.fallback.append)

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc) -> None:
        self.a.close()
        self.b.close()


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("psnode-lane")]


@pytest.fixture(autouse=True)
def no_threads_left():
    yield
    deadline = time.monotonic() + 10
    while _lane_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _lane_threads(), _lane_threads()


def test_messages_arrive_whole_in_order_from_the_peer_the_handshake_named():
    big = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)  # more than a socket buffer
    with Pair() as pair:
        trackers = [pair.send(b"first"), pair.send(big), pair.send(b""), pair.send(b"last")]
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 4)
        assert [m[2] for m in pair.inbox.messages] == [b"first", big.tobytes(), b"", b"last"]
        assert {m[0] for m in pair.inbox.messages} == {"worker@a"}
        for tracker in trackers:
            tracker.wait(5)
        assert pair.fallback == []


def test_a_body_goes_straight_into_the_place_the_reader_names_and_others_into_its_own_buffer():
    with Pair() as pair:
        place = np.zeros(1 << 20, np.uint8)
        pair.inbox.places[7] = place
        value = np.full(1 << 20, 9, np.uint8)
        pair.send(value, place=7)
        pair.send(b"x" * 100, place=8)
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 2)
        assert pair.inbox.messages[0][3] and np.all(place == 9)
        assert not pair.inbox.messages[1][3] and pair.inbox.messages[1][2] == b"x" * 100


def test_a_message_the_reader_kept_is_not_overwritten_by_the_next_one():
    kept = []

    class Keeper(Inbox):
        def deliver(self, peer, place, body):
            kept.append(np.frombuffer(body, np.uint8))  # a view, as a collective not started yet keeps it
            super().deliver(peer, place, body)

    with Pair() as pair:
        pair.inbox.__class__ = Keeper
        pair.send(b"a" * 1000)
        pair.send(b"b" * 1000)
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 2)
        assert bytes(kept[0]) == b"a" * 1000 and bytes(kept[1]) == b"b" * 1000


def test_an_acceptor_without_the_jobs_key_gets_nothing_and_the_messages_take_the_fallback_in_order(caplog):
    with caplog.at_level(logging.WARNING, logger="psnode"), Pair(acceptor_key=b"\x01" * 32) as pair:
        trackers = [pair.send(b"one"), pair.send(b"two")]
        for tracker in trackers:
            tracker.wait(10)
        assert [m[1] for m in pair.fallback] == [b"one", b"two"]
        assert pair.send(b"three") is None  # the lane failed: the caller sends through its other path
        time.sleep(0.2)
        assert pair.inbox.messages == []
    assert any("cannot open a lane to worker b at 127.0.0.1" in r.message and "job's key" in r.message
               for r in caplog.records), caplog.text


def test_an_unreachable_lane_port_sends_through_the_fallback():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: connections are refused
        lanes = Lanes.listen("127.0.0.1", b"worker@a", "job-1", KEY)
        got = []
        try:
            tracker = lanes.send(b"worker@b", ("127.0.0.1", port), "worker b", [b"x", b"yz"], got.append)
            tracker.wait(10)
            assert got == [[b"x", b"yz"]]
        finally:
            lanes.close()


def _opener_hello(sock: socket.socket, opener: bytes = b"worker@a", acceptor: bytes = b"worker@b") -> tuple[bytes, bytes]:
    n1 = b"\x05" * 16
    sock.sendall(MAGIC + struct.pack("<H", len(opener)) + opener + struct.pack("<H", len(acceptor)) + acceptor + n1)
    answer = b""
    while len(answer) < 48:
        chunk = sock.recv(48 - len(answer))
        assert chunk, "the acceptor closed before it answered"
        answer += chunk
    return n1, answer


def _closed_by_peer(sock: socket.socket, timeout: float = 10) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("attack", ["garbage", "http", "wrong proof", "huge identity", "wrong acceptor"])
def test_what_a_stranger_sends_the_lane_port_is_refused_before_a_message_is_read_and_the_port_keeps_serving(attack, caplog):
    with caplog.at_level(logging.WARNING, logger="psnode"), Pair() as pair:
        with socket.create_connection(("127.0.0.1", pair.b.port), timeout=10) as raw:
            if attack == "garbage":
                raw.sendall(bytes(range(256)) * 64)
            elif attack == "http":
                raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            elif attack == "huge identity":
                raw.sendall(MAGIC + struct.pack("<H", 60000) + b"w" * 60000)
            elif attack == "wrong acceptor":
                raw.sendall(MAGIC + struct.pack("<H", 8) + b"worker@a" + struct.pack("<H", 8) + b"worker@c" + b"\0" * 16)
            else:  # the handshake as a worker would start it, then a proof made without the key
                n1, answer = _opener_hello(raw)
                raw.sendall(hmac.new(b"guess", answer, hashlib.sha256).digest())
                raw.sendall(PREFIX.pack(5, 0) + b"hello")
            assert _closed_by_peer(raw)
        pair.send(b"after")
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 1)
        assert [m[2] for m in pair.inbox.messages] == [b"after"] and pair.inbox.refusals == []
    assert any("refused a lane from 127.0.0.1" in r.message for r in caplog.records), caplog.text


def test_a_connection_that_says_nothing_is_dropped_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(lanes_module, "HANDSHAKE_TIMEOUT", 0.3)
    with Pair() as pair, socket.create_connection(("127.0.0.1", pair.b.port), timeout=10) as raw:
        assert _closed_by_peer(raw)  # within its 10 s, 33 times the handshake timeout


def test_an_opener_that_is_not_a_worker_of_the_job_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(lanes_module, "HANDSHAKE_TIMEOUT", 0.5)
    with caplog.at_level(logging.WARNING, logger="psnode"), Pair(known=()) as pair:
        pair.send(b"x")
        deadline = time.monotonic() + 10
        while not any("'worker@a' is not a node of this job that sends on lanes here" in r.message for r in caplog.records):
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
        assert pair.inbox.messages == []


def test_a_prefix_the_reader_refuses_closes_the_lane_and_names_why():
    with Pair() as pair:
        pair.a.send(b"worker@b", ("127.0.0.1", pair.b.port), "worker b", [PREFIX.pack(LIMIT + 1, 0)], pair.fallback.append)
        pair.inbox.wait(lambda: pair.inbox.refusals)
        assert pair.inbox.refusals == [f"a body of {LIMIT + 1} bytes (at most {LIMIT})"]
        assert pair.inbox.messages == []


def test_closing_ends_every_lane_thread_and_what_was_queued_still_arrives():
    with Pair() as pair:
        for i in range(20):
            pair.send(bytes([i]) * 100_000)
        pair.a.close()  # the opener closes at once: what it queued is written, then its end is shut
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 20)
        assert [m[2][:1] for m in pair.inbox.messages] == [bytes([i]) for i in range(20)]


def test_connections_beyond_the_handshakes_under_way_are_closed_at_once_and_the_port_serves_again(monkeypatch, caplog):
    monkeypatch.setattr(lanes_module, "MAX_HANDSHAKES", 2)
    with caplog.at_level(logging.WARNING, logger="psnode"), Pair() as pair:
        silent = [socket.create_connection(("127.0.0.1", pair.b.port), timeout=10) for _ in range(2)]
        try:
            deadline = time.monotonic() + 10
            while pair.b._handshaking < 2:  # both accepted, saying nothing
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with socket.create_connection(("127.0.0.1", pair.b.port), timeout=10) as third:
                assert _closed_by_peer(third)
                # at once: the two silent ones are still in their handshakes (they end after 10 s)
                assert pair.b._handshaking == 2
        finally:
            for sock in silent:
                sock.close()
        deadline = time.monotonic() + 10
        while pair.b._handshaking:  # the closed ones' handshakes ended (a worker opening meanwhile is refused too)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pair.send(b"after")
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 1)
    assert any("2 handshakes are already under way" in r.message for r in caplog.records), caplog.text


def test_a_message_the_lane_cannot_write_takes_the_fallback_and_its_tracker_is_done(caplog):
    class Unwritable:  # a buffer the kernel cannot take: the lane's thread must not die with it
        def __len__(self):
            return 3

    with caplog.at_level(logging.WARNING, logger="psnode"), Pair() as pair:
        pair.send(b"first")
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 1)
        tracker = pair.a.send(b"worker@b", ("127.0.0.1", pair.b.port), "worker b", [PREFIX.pack(3, 0), Unwritable()],
                              pair.fallback.append)
        tracker.wait(10)
        assert len(pair.fallback) == 1 and pair.fallback[0][0] == PREFIX.pack(3, 0)
    assert any("the lane to worker b failed: TypeError" in r.message for r in caplog.records), caplog.text


# ---- writing through: a sender writes a message on its own thread when the lane is idle ----------

class Gate(Inbox):
    """An inbox whose reader stops before the body of a message for place 99 until ``opened`` is
    set: the lane's socket then fills, as when a peer is slow to read."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()
        self.stopped = threading.Event()

    def destination(self, peer, place: int, size: int):
        if place == 99:
            self.stopped.set()
            assert self.opened.wait(10)
        return super().destination(peer, place, size)


def _through(pair: Pair, body, place: int = 0):
    return pair.a.write_through(b"worker@b", [PREFIX.pack(len(body), place), body])


def _opened(pair: Pair) -> socket.socket:
    """Open the lane with a first message and return its socket, once that message arrived."""
    pair.send(b"open").wait(10)  # written: the lane's thread is idle again
    pair.inbox.wait(lambda: len(pair.inbox.messages) == 1)
    return pair.a._out[b"worker@b"].sock


def test_a_message_written_through_an_idle_lane_is_in_the_kernel_when_the_call_returns():
    with Pair() as pair:
        assert _through(pair, b"x" * 1000) is None  # no lane opened yet: nothing written, send a copy
        _opened(pair)
        body = bytearray(b"x" * 300_000)
        tracker = _through(pair, body)
        assert tracker is not None and tracker.done
        body[:] = b"y" * len(body)  # the caller may change it at once: the kernel holds its own copy
        pair.send(b"after")
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 3)
        assert [m[2] for m in pair.inbox.messages] == [b"open", b"x" * 300_000, b"after"]
        assert pair.fallback == []


def test_nothing_is_written_through_a_lane_that_holds_messages_of_its_own_and_the_order_stays():
    with Pair() as pair:
        pair.inbox.__class__ = Gate
        pair.inbox.opened, pair.inbox.stopped = threading.Event(), threading.Event()
        _opened(pair)
        pair.send(b"s" * 1000, place=99)  # the reader stops before this body
        assert pair.inbox.stopped.wait(10)
        queued = [pair.send(bytes([i]) * 2_000_000) for i in range(6)]  # more than the kernel holds
        assert _through(pair, b"t" * 1000) is None  # the lane's thread has messages to write first
        pair.inbox.opened.set()
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 8)
        for tracker in queued:
            tracker.wait(10)
        assert [m[2][:1] for m in pair.inbox.messages] == [b"o", b"s"] + [bytes([i]) for i in range(6)]
        assert _through(pair, b"u" * 1000).done  # idle again
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 9)


def _taken_in_part(pair: Pair, body: np.ndarray):
    """Stop the reader, shrink the lane's send buffer, and write ``body`` through: the kernel takes a
    part of it and the rest waits on the lane's thread. Returns the tracker."""
    pair.inbox.__class__ = Gate
    pair.inbox.opened, pair.inbox.stopped = threading.Event(), threading.Event()
    sock = _opened(pair)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    pair.send(b"s" * 1000, place=99).wait(10)
    assert pair.inbox.stopped.wait(10)
    tracker = _through(pair, body)
    assert tracker is not None and not tracker.done  # a part was taken: the rest is the lane's
    return tracker


def test_a_message_the_socket_takes_in_part_is_finished_from_a_copy_after_the_caller_changed_it():
    body = np.random.default_rng(2).integers(0, 255, LIMIT, dtype=np.uint8)
    original = body.tobytes()
    with Pair() as pair:
        tracker = _taken_in_part(pair, body)
        body[:] = 0  # the caller's array changes as soon as the call returned
        assert _through(pair, b"z" * 1000) is None  # the rest is still the lane's to write
        pair.inbox.opened.set()
        pair.inbox.wait(lambda: len(pair.inbox.messages) == 3)
        tracker.wait(10)
        assert pair.inbox.messages[2][2] == original
        assert pair.fallback == []


def test_a_lane_that_breaks_after_taking_part_of_a_message_written_through_sends_it_whole_again():
    body = np.random.default_rng(3).integers(0, 255, LIMIT, dtype=np.uint8)
    original = body.tobytes()
    with Pair() as pair:
        tracker = _taken_in_part(pair, body)
        body[:] = 0
        with pair.b._lock:
            accepted = list(pair.b._in.values())
        for sock in accepted:  # the peer's end goes away mid-message
            sock.shutdown(socket.SHUT_RDWR)
        tracker.wait(10)
        pair.inbox.opened.set()
        assert len(pair.fallback) == 1
        prefix, value = (bytes(b) for b in pair.fallback[0])
        assert prefix == PREFIX.pack(LIMIT, 0) and value == original  # what the caller gave, not its change
        assert pair.send(b"later") is None  # the lane is given up: its sender takes the other path
