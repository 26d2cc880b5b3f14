"""What a member sends wrong gets an error reply naming what was wrong, and the server goes on;
a worker takes a reply only from the server its request went to. In-process, on the inproc transport."""

import concurrent.futures
import re

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys

from psnode.errors import RemoteError
from psnode.node.protocol import Cmd, pack_header, pack_json, pack_value

pytestmark = pytest.mark.unit


@pytest.fixture
def job():
    with InProcJob(num_workers=2, num_servers=2, network_threads=False) as job:
        init_keys(job, {7: (0, np.zeros(4, np.float32))})
        yield job


def ask(worker, server, frames_for, what="probe", parts=1):
    """Send a hand-made message as a request of ``worker``; the future its reply completes."""
    future = concurrent.futures.Future()
    req = worker.requests.track(future, parts, [memoryview(bytearray(16))] * parts, what, server)
    worker.conn.transport.send(worker.servers[server].uid.encode(), frames_for(req))
    return future


def refusal(worker, future) -> str:
    assert worker.wait_for(future, 10), "no reply"
    with pytest.raises(RemoteError) as caught:
        future.result()
    return str(caught.value)


def test_a_truncated_push_pull_frame_fails_both_of_its_requests_and_the_server_goes_on(job):
    worker = job.workers[0]
    push = concurrent.futures.Future()
    push_req = worker.requests.track(push, 1, None, "push", 0)
    pull = ask(worker, 0, lambda req: [pack_header(Cmd.PUSH_PULL, req, push_req)])
    assert "a malformed PUSH_PULL from worker 0" in refusal(worker, pull)
    assert "shorter than its" in refusal(worker, push)
    out = np.zeros(4, np.float32)
    future = worker.pull([(0, 7, out)])
    assert worker.wait_for(future, 10) and future.result() is None  # the server still serves


@pytest.mark.parametrize("spec, expected", [
    ({"key": 9, "user_key": "w", "shape": "4", "dtype": "<f4", "frame": 0}, r"shape '4' is not a list"),
    ({"key": 9, "user_key": "w", "shape": [4], "dtype": "|O", "frame": 0}, r"dtype object is not one a key may have"),
    ({"key": 9, "user_key": "w", "shape": [4], "dtype": "<f4", "frame": 3}, r"data frame 3 is not one of the message's 1"),
    ({"key": -1, "user_key": "w", "shape": [4], "dtype": "<f4", "frame": 0}, r"key id -1 is not a 64-bit"),
    ({"key": 9, "user_key": [1], "shape": [4], "dtype": "<f4", "frame": 0}, r"neither int nor str"),
    ({"key": 9, "user_key": "w", "shape": [400], "dtype": "<f4", "frame": 0}, r"reach past its data frame of 16 bytes"),
])
def test_a_malformed_init_is_refused_naming_the_field(job, spec, expected):
    worker = job.workers[0]
    future = ask(worker, 1, lambda req: [pack_header(Cmd.INIT, req, 1), pack_json([spec]), bytes(16)], "init")
    assert re.search(expected, refusal(worker, future))


def test_a_push_with_a_truncated_meta_frame_is_refused(job):
    worker = job.workers[0]
    future = ask(worker, 0, lambda req: [pack_header(Cmd.PUSH, req, 1), b"\x01\x02\x03", bytes(16)], "push")
    assert "meta frame of 3 bytes" in refusal(worker, future)


def test_only_worker_0_may_ship_an_updater(job):
    worker = job.workers[1]
    future = ask(worker, 0, lambda req: [pack_header(Cmd.SET_UPDATER, req, 1), b"not even a pickle"], "set_updater")
    assert "worker 1 on" in refusal(worker, future) and "worker 0 ships it" in refusal(worker, future)


def test_a_reply_from_a_server_the_request_did_not_go_to_is_not_taken(job):
    worker = job.workers[0]
    out = np.zeros(4, np.float32)
    future = worker.pull([(0, 7, out)])
    req = max(worker.requests.pending)
    other = job.servers[1]
    worker_uid = worker.conn.me.uid.encode()
    other.conn.transport.send(worker_uid, [pack_value(req, 0, np.full(4, 666, np.float32).tobytes())])
    assert worker.wait_for(future, 10) and future.result() is None
    assert out.tolist() == [0.0] * 4  # the real server's value, not the forged one
    assert worker.conn.link.malformed >= 1
