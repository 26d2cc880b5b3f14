"""Transport conformance: every registered transport moves frames between named peers the same way."""

import os
import time

import numpy as np
import pytest

from psnode.errors import ClosedError, PSNodeError, TransportError
from psnode.transport.base import create_transport, transport_names
from testkit import free_port

pytestmark = pytest.mark.unit


@pytest.fixture(params=transport_names())
def pair(request):
    name = f"conf-{os.getpid()}-{request.param}"
    a = create_transport(request.param, b"node-a")
    b = create_transport(request.param, b"node-b")
    try:
        port_a = a.bind(0, name + "-a")
        port_b = b.bind(0, name + "-b")
        yield request.param, a, b, port_a, port_b, name
    finally:
        a.close()
        b.close()


def recv(transport, timeout=5.0):
    assert transport.poll(timeout), "no message arrived"
    return transport.recv()


def test_frames_travel_both_ways_with_the_senders_identity(pair):
    _, a, b, port_a, port_b, _ = pair
    a.connect(b"node-b", f"tcp://127.0.0.1:{port_b}")
    b.connect(b"node-a", f"tcp://127.0.0.1:{port_a}")
    big = np.arange(5 * 2**20 // 4, dtype=np.float32)
    a.send(b"node-b", [b"header", b"", big])
    sender, frames = recv(b)
    assert sender == b"node-a" and frames[0].bytes == b"header" and frames[1].bytes == b""
    assert np.array_equal(np.frombuffer(frames[2].buffer, dtype=np.float32), big)
    b.send(b"node-a", [b"reply"])
    sender, frames = recv(a)
    assert sender == b"node-b" and [f.bytes for f in frames] == [b"reply"]


def test_the_same_host_endpoint_carries_frames(pair):
    _, a, b, _, _, name = pair
    a.connect(b"node-b", b.same_host_endpoint(name + "-b"))
    a.send(b"node-b", [b"over the same-host path"])
    sender, frames = recv(b)
    assert sender == b"node-a" and frames[0].bytes == b"over the same-host path"


def test_messages_from_one_peer_arrive_in_order(pair):
    _, a, b, _, port_b, _ = pair
    a.connect(b"node-b", f"tcp://127.0.0.1:{port_b}")
    for i in range(200):
        a.send(b"node-b", [str(i).encode()])
    assert [int(recv(b)[1][0].bytes) for _ in range(200)] == list(range(200))


def test_a_tracked_send_reports_when_the_buffer_is_free(pair):
    _, a, b, _, port_b, _ = pair
    a.connect(b"node-b", f"tcp://127.0.0.1:{port_b}")
    tracker = a.send(b"node-b", [b"h", np.ones(2**20, np.uint8)], track=True)
    recv(b)
    tracker.wait(5)
    assert tracker.done


def test_poll_times_out_when_nothing_arrives(pair):
    _, a, _, _, _, _ = pair
    assert a.poll(0.05) is False


def test_sending_to_an_unknown_peer_is_a_transport_error_naming_it(pair):
    _, a, _, _, _, _ = pair
    with pytest.raises(TransportError, match="nobody"):
        a.send(b"nobody", [b"x"])


def test_binding_a_taken_port_is_a_transport_error_naming_the_port(pair):
    kind, _, _, port_a, _, _ = pair
    other = create_transport(kind, b"node-c")
    try:
        with pytest.raises(TransportError, match=f"TCP port {port_a}"):
            other.bind(port_a)
    finally:
        other.close()


def test_a_closed_transport_refuses_every_call_with_closed_error(pair):
    _, a, _, _, port_b, _ = pair
    a.connect(b"node-b", f"tcp://127.0.0.1:{port_b}")
    a.close()
    a.close()  # idempotent
    for call in (lambda: a.send(b"node-b", [b"x"]), lambda: a.poll(0), lambda: a.connect(b"x", "tcp://127.0.0.1:1")):
        with pytest.raises(ClosedError):
            call()


def test_an_unknown_transport_name_lists_the_known_ones():
    with pytest.raises(PSNodeError, match="known transports: .*zmq"):
        create_transport("carrier-pigeon", b"x")


def test_free_port_gives_a_bindable_port():
    kind = transport_names()[0]
    t = create_transport(kind, b"x")
    try:
        port = free_port()
        assert t.bind(port) == port
    finally:
        t.close()


def test_wake_from_another_thread_ends_a_long_poll_without_a_message(pair):
    import threading

    _, a, b, _, port_b, _ = pair
    waker = threading.Timer(0.1, a.wake)
    waker.start()
    try:
        assert a.poll(60) is False  # returns long before 60 s (the test's own timeout guards it)
    finally:
        waker.join()
    b.connect(b"node-a", a.same_host_endpoint(pair[5] + "-a"))
    b.send(b"node-a", [b"after the wake"])
    sender, frames = recv(a)
    assert sender == b"node-b" and frames[0].bytes == b"after the wake"


def test_a_wake_before_the_poll_is_not_lost(pair):
    _, a, _, _, _, _ = pair
    a.wake()
    assert a.poll(60) is False


def test_many_small_frames_arrive_as_sent_whatever_their_kind(pair):
    _, a, b, _, port_b, _ = pair
    a.connect(b"node-b", f"tcp://127.0.0.1:{port_b}")
    small = [b"h" * 24, b"", b"m" * 40, np.arange(4, dtype=np.float32).tobytes(), b"\x00PJ looks joined"]
    a.send(b"node-b", small)
    a.send(b"node-b", [b"header", np.arange(4, dtype=np.float32)])  # not all bytes: frame by frame
    a.send(b"node-b", [b"x" * 70000, b"y"])  # too big to travel joined
    assert [f.bytes for f in recv(b)[1]] == small
    frames = recv(b)[1]
    assert frames[0].bytes == b"header" and np.frombuffer(frames[1].buffer, np.float32).tolist() == [0, 1, 2, 3]
    assert [len(f.buffer) for f in recv(b)[1]] == [70000, 1]


def test_a_single_frame_that_only_looks_joined_arrives_as_it_came(pair):
    _, a, b, _, port_b, _ = pair
    a.connect(b"node-b", f"tcp://127.0.0.1:{port_b}")
    for junk in [b"\x00PJ", b"\x00PJ\x02\x00\x05\x00\x00\x00", b"\x00PJ\x01\x00\x09\x00\x00\x00abc"]:
        a.send(b"node-b", [junk])
        assert [f.bytes for f in recv(b)[1]] == [junk]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_io_sched_batch_runs_zeromqs_io_thread_under_sched_batch():
    from psnode.transport.zeromq import ZmqTransport

    for sched, policy in [("batch", os.SCHED_BATCH), ("normal", os.SCHED_OTHER)]:
        before = set(os.listdir("/proc/self/task"))
        transport = ZmqTransport(b"node", io_sched=sched)
        try:
            transport.bind(0)  # the first socket starts the I/O thread
            deadline = time.monotonic() + 5
            while True:  # the thread names itself once it runs, a moment after bind returns
                new = set(os.listdir("/proc/self/task")) - before
                mine = [os.sched_getscheduler(int(t)) for t in new if _thread_name(t).startswith("ZMQbg/IO")]
                if mine or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert mine == [policy], (sched, mine)
        finally:
            transport.close()


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as fh:
            return fh.read()
    except FileNotFoundError:  # it ended meanwhile
        return ""
