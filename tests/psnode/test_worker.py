"""The worker's send queue and request bookkeeping, driven in-process through a stand-in connection."""

import numpy as np
import pytest

from psnode.env import read_env
from psnode.errors import PeerDiedError
from psnode.node import PeerInfo
from psnode.protocol import FLAG_PULL, PUSH_PULL, Cmd, unpack_entries, unpack_header
from psnode.transport import WouldBlock
from psnode.worker import WorkerNode

ENV = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
       "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "2"}


@pytest.fixture
def worker():
    node = WorkerNode(read_env(ENV))
    node.rank = 0
    node.servers = [PeerInfo("server", r, "127.0.0.1", 2000 + r, f"server@127.0.0.1:{2000 + r}", "x", "x") for r in range(2)]
    node.sent = []
    node.full = False

    def send(peer, frames, track=False, block=True):
        if node.full:
            raise WouldBlock("full")
        node.sent.append((peer, frames))

    node.transport.send = send
    try:
        yield node
    finally:
        node.transport.close()


def test_queued_sends_leave_in_priority_order_then_call_order(worker):
    worker.full = True
    for key, priority in [(1, 0), (2, 5), (3, -1), (4, 5), (5, 0)]:
        worker.push([(0, key, np.ones(2, np.float32))], priority)
    assert worker.sent == []
    worker.full = False
    worker._pump()
    keys = [unpack_entries(frames[1])[0][0] for _, frames in worker.sent]
    assert keys == [2, 4, 1, 5, 3]


def test_parts_for_one_server_travel_in_one_message(worker):
    parts = [(k % 2, k, np.full(3, k, np.float32)) for k in range(10)]
    worker.push(parts)
    assert len(worker.sent) == 2
    for peer, frames in worker.sent:
        entries = unpack_entries(frames[1])
        assert len(entries) == 5 and unpack_header(frames[0])[3] == 5
        payload = np.frombuffer(frames[2], np.float32).reshape(5, 3)
        assert [int(row[0]) for row in payload] == [e[0] for e in entries]


def test_pulls_carry_the_number_of_pushes_they_must_include(worker):
    worker.push([(1, 7, np.ones(2, np.float32))])
    worker.push([(1, 7, np.ones(2, np.float32))])
    worker.pull([(1, 7, np.zeros(2, np.float32))])
    pull = unpack_entries(worker.sent[-1][1][1])
    assert pull[0][0] == 7 and pull[0][5] == 2


def test_requests_in_flight_fail_with_the_dead_peer_and_bookkeeping_empties(worker):
    futures = [worker.push([(0, k, np.ones(2, np.float32))]) for k in range(5)]
    assert len(worker._pending) == 5
    worker.fail(PeerDiedError("server 0 on 127.0.0.1:2000 died", "server", 0, "127.0.0.1"))
    for future in futures:
        with pytest.raises(PeerDiedError, match="server 0"):
            future.result(1)
    assert worker._pending == {}
    with pytest.raises(PeerDiedError):
        worker.push([(0, 1, np.ones(2, np.float32))])


def test_a_held_small_push_and_the_pull_of_the_same_part_travel_as_one_push_pull_frame(worker):
    worker._parked = True  # as when the network thread waits for a caller's next call
    worker.push([(1, 7, np.arange(2, dtype=np.float32))])
    assert worker.sent == []  # held back for a pull to join it
    worker.pull([(1, 7, np.zeros(2, np.float32))])
    assert len(worker.sent) == 1
    frames = worker.sent[0][1]
    assert len(frames) == 1
    fields = PUSH_PULL.unpack_from(frames[0])
    cmd, (pull_req, push_req), (key, index, _, nbytes, seq) = fields[2], fields[5:7], fields[7:]
    assert cmd == Cmd.PUSH_PULL and pull_req > push_req and (key, index, nbytes, seq) == (7, 0, 8, 1)
    assert np.frombuffer(frames[0][PUSH_PULL.size:], np.float32).tolist() == [0, 1]


def test_a_held_small_push_carries_a_pull_of_other_parts_of_its_server_in_one_message(worker):
    worker._parked = True
    worker.push([(1, 7, np.ones(2, np.float32))])
    worker.pull([(1, 8, np.zeros(2, np.float32))])
    assert len(worker.sent) == 1
    frames = worker.sent[0][1]
    cmd, flags, _, _ = unpack_header(frames[0])
    assert cmd == Cmd.PUSH and flags & FLAG_PULL and len(frames) == 5
    pull_cmd, _, _, _ = unpack_header(frames[3])
    assert pull_cmd == Cmd.PULL and unpack_entries(frames[4])[0][:1] == (8,)


def test_a_held_push_leaves_on_its_own_before_a_pull_of_another_server_or_a_wait(worker):
    worker._parked = True
    worker.push([(1, 7, np.ones(2, np.float32))])
    worker.pull([(0, 8, np.zeros(2, np.float32))])
    assert [unpack_header(frames[0])[:2] for _, frames in worker.sent] == [(Cmd.PUSH, 0), (Cmd.PULL, 0)]
    future = worker.push([(1, 7, np.ones(2, np.float32))])
    assert len(worker.sent) == 2
    worker.wait_for(future, 0.01)
    assert len(worker.sent) == 3 and unpack_header(worker.sent[2][1][0])[:2] == (Cmd.PUSH, 0)


def test_big_parts_travel_in_messages_of_their_own_and_small_ones_together(worker):
    big = np.arange(20000, dtype=np.float32)  # 80 KB: a frame of its own
    worker.push([(0, 1, big), (0, 2, np.ones(2, np.float32)), (0, 3, big + 1), (0, 4, np.ones(2, np.float32))])
    pushes = [frames for _, frames in worker.sent]
    assert [unpack_header(f[0])[3] for f in pushes] == [1, 1, 2]  # parts per message
    assert [unpack_entries(f[1])[0][0] for f in pushes[:2]] == [1, 3]
    assert np.array_equal(np.frombuffer(pushes[1][3], np.float32), big + 1)
    assert [e[0] for e in unpack_entries(pushes[2][1])] == [2, 4]
    worker.sent.clear()
    worker.pull([(0, 1, np.zeros(20000, np.float32)), (0, 2, np.zeros(2, np.float32)), (0, 3, np.zeros(20000, np.float32))])
    pulls = [frames for _, frames in worker.sent]
    assert [[e[:2] for e in unpack_entries(f[1])] for f in pulls] == [[(1, 0)], [(3, 2)], [(2, 1)]]
    assert len({unpack_header(f[0])[2] for f in pulls}) == 1  # one request, answered part by part
