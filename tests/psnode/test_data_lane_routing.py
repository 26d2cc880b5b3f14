"""Data lanes (psnode.node.data_lanes): which messages a node sends on them, their prefix, and a
worker's and a server's ``DataLanes`` over real lanes (TCP on 127.0.0.1, the job key's proof)
within one process. The transport they hand messages to is the test's recorder of ``inject`` and
``send_here``: the face of ``ZmqTransport`` data lanes use."""

from __future__ import annotations

import queue
import struct
import threading

import numpy as np
import pytest

from psnode.errors import ProtocolError
from psnode.node.data_lanes import LANE_MIN, PREFIX, DataLanes, _unpack_prefix, pack_prefix
from psnode.node.membership import Membership, PeerInfo
from psnode.node.protocol import (
    ENTRY_STRUCT,
    FLAG_ACKS,
    FLAG_ERROR,
    FLAG_MIRROR,
    FLAG_OFFER,
    FLAG_PULL,
    Cmd,
    pack_header,
)
from psnode.transport import zeromq
from psnode.transport.lanes import Lanes
from psnode.transport.zeromq import ZmqTransport

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
LIMIT = 64 << 20


class Recorder:
    """What data lanes hand to the node (``inject``) and send through ZeroMQ instead (``send_here``)."""

    def __init__(self) -> None:
        self.injected: queue.Queue = queue.Queue()
        self.here: list = []
        self.lane_router = None

    def inject(self, sender: bytes, frames: list) -> None:
        self.injected.put((sender, frames))

    def send_here(self, peer: bytes, frames: list, track: bool = False, block: bool = True) -> None:
        self.here.append((peer, frames))

    @staticmethod
    def same_host_endpoint(local_name: str) -> str:
        return f"ipc://@{local_name}"


class Node:
    """One side: its lanes, recorder, book and ``DataLanes``; ``malformed`` what it counted."""

    def __init__(self, role: str, uid: str, fingerprint: str, same_host: str = "tcp", key: bytes = KEY) -> None:
        self.lanes = Lanes.listen("127.0.0.1", uid.encode(), "job-1", key, what="data", in_order=True)
        self.me = PeerInfo(role, 0, "127.0.0.1", 1, uid, fingerprint, uid, data_port=self.lanes.port)
        self.members = Membership(role)
        self.transport = Recorder()
        self.malformed: queue.Queue = queue.Queue()
        self.data = DataLanes(self.lanes, self.transport, self.members, self.me, same_host, LIMIT,
                              lambda sender, exc: self.malformed.put((sender, str(exc))))
        self.data.start()

    def knows(self, *peers: "Node") -> None:
        self.members.peers = {p.me.uid.encode(): p.me for p in peers}


@pytest.fixture
def pair():
    server = Node("server", "server@s", "host-s")
    worker = Node("worker", "worker@w", "host-w")
    server.knows(worker)
    worker.knows(server)
    yield worker, server
    worker.lanes.close()
    server.lanes.close()
    for thread in [t for t in threading.enumerate() if t.name.startswith("psnode-lane")]:
        thread.join(10)  # closed lanes end their threads: none is left
    assert not [t.name for t in threading.enumerate() if t.name.startswith("psnode-lane")]


def push(value: np.ndarray, flags: int = 0, payload: bytes = b"") -> list:
    return [pack_header(Cmd.PUSH, 7, 1, flags), ENTRY_STRUCT.pack(42, 0, 1, 0, 0, value.nbytes, 3), payload, value]


def reply(value: np.ndarray, req: int = 9, acks: bytes | None = None, flags: int = 0) -> list:
    frames = [pack_header(Cmd.PULL_REPLY, req, 0, flags | (FLAG_ACKS if acks else 0)),
              ENTRY_STRUCT.pack(42, 0, 1, 0, 0, value.nbytes, 0), b"", value]
    return frames + [acks] if acks else frames


def test_a_big_push_reaches_the_server_whole_as_the_frames_the_worker_sent(pair):
    worker, server = pair
    value = np.random.default_rng(0).standard_normal(LANE_MIN // 4 * 3).astype(np.float32)
    frames = push(value)
    tracker = worker.data.route(b"server@s", frames)
    assert tracker is not None
    sender, got = server.transport.injected.get(timeout=10)
    assert sender == b"worker@w"
    assert [f.buffer.tobytes() for f in got] == [frames[0], frames[1], b"", value.tobytes()]
    tracker.wait(5)
    assert worker.data.sent == 1 and server.data.received == 1 and server.data.in_place == 0


def test_a_push_written_through_the_idle_lane_reaches_the_server_whole_and_the_worker_may_change_it(pair):
    worker, server = pair
    value = np.random.default_rng(4).standard_normal(LANE_MIN // 4 * 3).astype(np.float32)
    original = value.copy()
    assert worker.data.write_through(b"server@s", push(value)) is None  # no lane opened yet
    worker.data.route(b"server@s", push(original)).wait(10)  # opens it; written: idle again
    server.transport.injected.get(timeout=10)
    frames = push(value)
    tracker = worker.data.write_through(b"server@s", frames)
    assert tracker is not None and tracker.done
    value[:] = -1  # the kernel holds the bytes: the caller may change its array at once
    _, got = server.transport.injected.get(timeout=10)
    assert [f.buffer.tobytes() for f in got] == [frames[0], frames[1], b"", original.tobytes()]
    assert worker.data.sent == 2 and worker.data.written_through == 1
    # what goes on no lane is not written through either
    assert worker.data.write_through(b"server@s", push(big, FLAG_PULL)) is None
    assert worker.data.write_through(b"server@s", push(np.ones(16, np.float32))) is None
    assert worker.data.write_through(b"worker@other", push(big)) is None  # not in the book


def test_messages_a_failed_lane_gives_back_go_through_zeromq_each_as_its_own_frames():
    server = Node("server", "server@s", "host-s", key=b"\x01" * 32)  # the lane's handshake fails
    worker = Node("worker", "worker@w", "host-w")
    server.knows(worker)
    worker.knows(server)
    try:
        sent = [push(np.full(LANE_MIN // 4, i, np.float32)) for i in range(3)]
        trackers = []
        for frames in sent:
            tracker = worker.data.route(b"server@s", frames)
            if tracker is None:  # the lane failed already, and gave back what it held: the node sends it itself
                worker.transport.send_here(b"server@s", frames)
            trackers.append(tracker)
        assert trackers[0] is not None  # the first opens the lane: it is queued there
        for tracker in trackers:
            if tracker is not None:
                tracker.wait(10)
        assert [peer for peer, _ in worker.transport.here] == [b"server@s"] * 3
        for (_, frames), expected in zip(worker.transport.here, sent):
            assert [bytes(f) for f in frames[:3]] == expected[:3]
            assert np.array_equal(np.frombuffer(frames[3], np.float32), expected[3])
    finally:
        worker.lanes.close()
        server.lanes.close()


def test_a_pull_reply_is_read_straight_into_the_out_its_worker_names_with_its_acknowledgements(pair):
    worker, server = pair
    value = np.arange(LANE_MIN // 4, dtype=np.float32)
    out = np.zeros_like(value)
    target = memoryview(out).cast("B")
    asked = []

    def find_out(req_id, index, nbytes, rank):
        asked.append((req_id, index, nbytes, rank))
        return target if req_id == 9 else None

    worker.data.find_out = find_out
    acks = np.array([(5, 1), (6, 2)], dtype=np.uint64).tobytes()
    assert server.data.route(b"worker@w", reply(value, acks=acks)) is not None
    _, got = worker.transport.injected.get(timeout=10)
    assert got[3].buffer is target and np.array_equal(out, value)  # no copy left to make
    assert got[4].buffer.tobytes() == acks
    assert asked == [(9, 0, value.nbytes, 0)] and worker.data.in_place == 1
    # a reply no pull waits for lands in memory of its own
    assert server.data.route(b"worker@w", reply(value * 2, req=10)) is not None
    _, got = worker.transport.injected.get(timeout=10)
    assert got[3].buffer is not target and np.array_equal(np.frombuffer(got[3].buffer, np.float32), value * 2)
    assert np.array_equal(out, value) and worker.data.in_place == 1


big = np.ones(LANE_MIN // 4, np.float32)


@pytest.mark.parametrize("frames", [
    push(np.ones(LANE_MIN // 4 - 1, np.float32)),  # below LANE_MIN
    push(big, FLAG_PULL), push(big, FLAG_OFFER), push(big, FLAG_MIRROR),
    push(big, payload=b"x"),  # small values beside it
    push(big) + [b"more"],
    push(np.ones((LANE_MIN // 2, 2), np.float32)[:, 0]),  # not contiguous
    [pack_header(Cmd.INIT, 7, 1), b"", b"", big],
], ids=["small", "carries-a-pull", "offered", "mirrored", "payload", "five-frames", "strided", "init"])
def test_what_does_not_fit_a_lane_goes_through_zeromq(pair, frames):
    worker, _ = pair
    assert worker.data.route(b"server@s", frames) is None
    assert worker.data.sent == 0


def test_replies_and_peers_that_do_not_take_lanes_go_through_zeromq(pair):
    worker, server = pair
    assert server.data.route(b"worker@w", reply(big, flags=FLAG_ERROR)) is None
    assert server.data.route(b"worker@w", reply(big)[:3] + [big, big]) is None  # two values
    assert worker.data.route(b"worker@other", push(big)) is None  # not in the book
    other = Node("server", "server@t", "host-w", same_host="ipc")  # the worker's host: the same-host path
    try:
        worker.members.peers = {**worker.members.peers, b"server@t": other.me}
        worker.data.same_host = "ipc"
        assert worker.data.route(b"server@t", push(big)) is None
    finally:
        other.lanes.close()
    assert server.data.route(b"server@s", reply(big)) is None  # a server takes no lane from a server
    assert worker.data.sent == 0 and server.data.sent == 0


def test_prefixes_round_trip_and_what_does_not_fit_one_is_not_packed():
    value = big
    acks = b"\1" * 16 * 3
    frames = reply(value, acks=acks)
    prefix = pack_prefix(frames, value.nbytes)
    assert len(prefix) == PREFIX
    nbytes, before, after = _unpack_prefix(prefix, LIMIT)
    assert nbytes == value.nbytes and before == frames[:3] and after == [acks]
    assert pack_prefix(reply(value, acks=b"\1" * 16 * 20), value.nbytes) is None  # too many acknowledgements
    assert pack_prefix([frames[0], memoryview(frames[1]), b"", value], value.nbytes) is None  # not bytes


def _forged(nbytes=LANE_MIN, before=3, after=0, lengths=(24, 40, 0), spare=0, meta=None) -> bytes:
    meta = sum(lengths) if meta is None else meta
    head = struct.pack("<QHHHH", nbytes, before, after, meta, spare) + struct.pack(f"<{len(lengths)}I", *lengths)
    return head.ljust(PREFIX, b"\0")


@pytest.mark.parametrize("prefix, words", [
    (_forged(before=2, lengths=(24, 40)), "2 frames before the value and 0 after"),
    (_forged(after=2, lengths=(24, 40, 0, 1, 1)), "3 frames before the value and 2 after"),
    (_forged(spare=1), "3 frames before the value and 0 after"),
    (_forged(lengths=(24, 40, 400)), "frames of [24, 40, 400] bytes do not fit its 256"),
    (_forged(meta=10), "frames of [24, 40, 0] bytes do not fit"),
    (_forged(nbytes=LANE_MIN - 1), f"a value of {LANE_MIN - 1} bytes ({LANE_MIN} to {LIMIT})"),
    (_forged(nbytes=LIMIT + 1), f"a value of {LIMIT + 1} bytes"),
])
def test_a_prefix_no_data_lane_sends_is_refused_naming_what_is_wrong(prefix, words):
    with pytest.raises(ProtocolError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        _unpack_prefix(prefix, LIMIT)


def test_a_lane_message_of_a_command_this_side_does_not_take_closes_that_lane_and_the_node_serves_on(pair):
    worker, server = pair
    # worker w (it holds the key) sends the server a pull reply: no server takes that on a lane
    forged = Lanes.listen("127.0.0.1", b"worker@w", "job-1", KEY)
    try:
        frames = reply(big)
        forged.send(b"server@s", ("127.0.0.1", server.lanes.port), "server s", [pack_prefix(frames, big.nbytes), big],
                    lambda again: None)
        sender, why = server.malformed.get(timeout=10)
        assert sender == b"worker@w"
        assert "a data lane message PULL_REPLY; a server takes only PUSH on its lanes" in why
        assert "on its data lane, which this node closed" in why
    finally:
        forged.close()
    assert server.transport.injected.empty()
    # the worker's own lane (a new one: the forged one took its identity's place) still carries pushes
    assert worker.data.route(b"server@s", push(big)) is not None
    sender, got = server.transport.injected.get(timeout=10)
    assert sender == b"worker@w" and got[3].buffer.tobytes() == big.tobytes()


def test_the_transport_holds_a_bounded_inbox_of_handed_in_messages_and_then_the_hand_in_waits():
    transport = ZmqTransport(b"server@x")
    transport.bind(0, None, "127.0.0.1")
    try:
        limit = zeromq._INBOX_MAX
        for i in range(limit):
            transport.inject(b"worker@w", [i])
        done = threading.Event()
        late = threading.Thread(target=lambda: (transport.inject(b"worker@w", ["last"]), done.set()))
        late.start()
        assert not done.wait(0.3)  # the lane's reader waits: it reads no more meanwhile
        assert transport.poll(0) and transport.recv() == (b"worker@w", [0])
        assert done.wait(5)
        late.join(5)
        assert [transport.recv()[1][0] for _ in range(limit)] == [*range(1, limit), "last"]
        assert not transport.poll(0)
    finally:
        transport.close()
