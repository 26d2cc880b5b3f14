"""The worker's request logic on an in-process job: what it sends, in which order, and how replies end requests."""

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys, on_threads, sent, sent_headers, sent_keys

from psnode.errors import ClosedError, PeerDiedError, RemoteError
from psnode.node.protocol import FLAG_PULL, Cmd, unpack_entries, unpack_header, unpack_push_pull

pytestmark = pytest.mark.unit


@pytest.fixture
def job():
    """One worker with no network thread (the test's calls receive) and two servers."""
    with InProcJob(num_workers=1, num_servers=2, network_threads=False) as job:
        init_keys(job, {k: (k % 2, np.zeros(2, np.float32)) for k in range(1, 9)})
        job.workers[0].conn.transport.record = True
        yield job


def wait(worker, future):
    assert worker.wait_for(future, 10), "no reply within 10 s"
    return future.result()


def server_uid(job, rank):
    return job.workers[0].servers[rank].uid.encode()


def test_queued_sends_leave_in_priority_order_then_call_order(job):
    worker = job.workers[0]
    worker.conn.transport.full.add(server_uid(job, 0))
    futures = [worker.push([(0, key, np.ones(2, np.float32))], priority) for key, priority in
               [(2, 0), (4, 5), (6, -1), (8, 5)]]
    assert sent(worker) == []  # the connection is full: everything waits in the queue
    worker.conn.transport.full.clear()
    worker.outbox.pump()
    assert [sent_keys(frames)[0] for _, frames in sent(worker)] == [4, 8, 2, 6]
    for future in futures:
        wait(worker, future)


def test_parts_for_one_server_travel_in_one_message_and_the_sums_are_exact(job):
    worker = job.workers[0]
    wait(worker, worker.push([(k % 2, k, np.full(2, k, np.float32)) for k in range(1, 9)]))
    assert sorted(len(sent_keys(frames)) for _, frames in sent(worker)) == [4, 4]
    outs = {k: np.zeros(2, np.float32) for k in range(1, 9)}
    wait(worker, worker.pull([(k % 2, k, out) for k, out in outs.items()]))
    assert all(out.tolist() == [k, k] for k, out in outs.items())


def test_pulls_carry_the_number_of_pushes_they_must_include(job):
    worker = job.workers[0]
    worker.push([(1, 7, np.ones(2, np.float32))])
    worker.push([(1, 7, np.ones(2, np.float32))])
    future = worker.pull([(1, 7, np.zeros(2, np.float32))])
    pull = [frames for _, frames in sent(worker) if unpack_header(frames[0])[0] == Cmd.PULL][-1]
    assert unpack_entries(pull[1])[0][0] == 7 and unpack_entries(pull[1])[0][6] == 2
    wait(worker, future)


def test_requests_in_flight_fail_with_the_dead_peer_and_bookkeeping_empties(job):
    job.expect_failure = True
    worker = job.workers[0]
    worker.conn.transport.full.add(server_uid(job, 0))  # so they stay in flight
    futures = [worker.push([(0, k, np.ones(2, np.float32))]) for k in (2, 4, 6)]
    assert len(worker.requests.pending) == 3
    worker.conn.failure.fail(PeerDiedError("server 0 on 127.0.0.1:2000 died", "server", 0, "127.0.0.1"))
    for future in futures:
        with pytest.raises(PeerDiedError, match="server 0"):
            future.result(1)
    assert worker.requests.pending == {}
    with pytest.raises(PeerDiedError):
        worker.push([(0, 2, np.ones(2, np.float32))])


def test_a_held_small_push_and_the_pull_of_the_same_part_travel_as_one_push_pull_frame(job):
    worker = job.workers[0]
    worker.outbox.held.parked = True  # as when the network thread waits for a caller's next call
    push = worker.push([(1, 7, np.arange(2, dtype=np.float32))])
    assert sent(worker) == []  # held back for a pull to join it
    out = np.zeros(2, np.float32)
    pull = worker.pull([(1, 7, out)])
    (_, frames), = sent(worker)
    assert len(frames) == 1
    pull_req, push_req, key, index, codec, nbytes, seq = unpack_push_pull(frames[0])
    assert unpack_header(frames[0])[0] == Cmd.PUSH_PULL and pull_req > push_req
    assert (key, index, codec, nbytes, seq) == (7, 0, 0, 8, 1)
    worker.outbox.held.parked = False
    wait(worker, pull)
    assert push.done() and push.exception() is None and out.tolist() == [0, 1]


def test_a_held_small_push_carries_a_pull_of_other_parts_of_its_server_in_one_message(job):
    worker = job.workers[0]
    worker.outbox.held.parked = True
    push = worker.push([(1, 7, np.ones(2, np.float32))])
    pull = worker.pull([(1, 5, np.zeros(2, np.float32))])
    (_, frames), = sent(worker)
    cmd, flags, _, _ = unpack_header(frames[0])
    assert cmd == Cmd.PUSH and flags & FLAG_PULL and len(frames) == 5
    assert unpack_header(frames[3])[0] == Cmd.PULL and sent_keys(frames[3:]) == [5]
    worker.outbox.held.parked = False
    wait(worker, pull)
    assert push.done() and push.exception() is None


def test_a_held_push_leaves_on_its_own_before_a_pull_of_another_server_or_a_wait(job):
    worker = job.workers[0]
    worker.outbox.held.parked = True
    worker.push([(1, 7, np.ones(2, np.float32))])
    pull = worker.pull([(0, 8, np.zeros(2, np.float32))])
    assert [h[:2] for h in sent_headers(worker)] == [(Cmd.PUSH, 0), (Cmd.PULL, 0)]
    future = worker.push([(1, 7, np.ones(2, np.float32))])
    assert len(sent(worker)) == 2  # held again
    worker.outbox.held.parked = False
    wait(worker, future)  # a caller that waits sends what is held first
    assert len(sent(worker)) == 3 and sent_headers(worker)[2][:2] == (Cmd.PUSH, 0)
    wait(worker, pull)


def test_big_parts_travel_in_messages_of_their_own_and_small_ones_together():
    with InProcJob(num_workers=1, num_servers=1, network_threads=False) as job:
        big = np.arange(20000, dtype=np.float32)  # 80 KB: a frame of its own
        init_keys(job, {1: (0, big * 0), 2: (0, np.zeros(2, np.float32)), 3: (0, big * 0), 4: (0, np.zeros(2, np.float32))})
        worker = job.workers[0]
        worker.conn.transport.record = True
        push = worker.push([(0, 1, big), (0, 2, np.ones(2, np.float32)), (0, 3, big + 1), (0, 4, np.ones(2, np.float32))])
        pushes = [frames for _, frames in sent(worker)]
        assert [unpack_header(f[0])[3] for f in pushes] == [1, 1, 2]  # parts per message
        assert [sent_keys(f)[0] for f in pushes[:2]] == [1, 3]
        assert np.array_equal(np.frombuffer(pushes[1][3], np.float32), big + 1)
        assert sent_keys(pushes[2]) == [2, 4]
        wait(worker, push)
        worker.conn.transport.outgoing.clear()
        outs = [np.zeros(20000, np.float32), np.zeros(2, np.float32), np.zeros(20000, np.float32)]
        pull = worker.pull([(0, 1, outs[0]), (0, 2, outs[1]), (0, 3, outs[2])])
        pulls = [frames for _, frames in sent(worker)]
        assert [[e[:2] for e in unpack_entries(f[1])] for f in pulls] == [[(1, 0)], [(3, 2)], [(2, 1)]]
        assert len({unpack_header(f[0])[2] for f in pulls}) == 1  # one request, answered part by part
        wait(worker, pull)
        assert np.array_equal(outs[0], big) and np.array_equal(outs[2], big + 1) and outs[1].tolist() == [1, 1]


def test_a_refused_request_fails_its_future_naming_the_server_and_why(job):
    worker = job.workers[0]
    future = worker.push([(0, 0xBEEF, np.ones(2, np.float32))])
    with pytest.raises(RemoteError, match=r"push failed on server 0 .*key id 0xbeef was never initialised"):
        wait(worker, future)


def test_a_closed_worker_refuses_new_requests():
    with InProcJob(num_workers=1, num_servers=1) as job:
        worker = job.workers[0]
        worker.close()
        with pytest.raises(ClosedError, match="worker 0 was closed"):
            worker.push([(0, 1, np.ones(2, np.float32))])


def test_two_workers_sum_exactly_through_threads_that_receive_for_themselves():
    with InProcJob(num_workers=2, num_servers=2) as job:
        init_keys(job, {1: (0, np.zeros(3, np.float32)), 2: (1, np.zeros(3, np.float32))})

        def rounds(worker):
            out = np.zeros(3, np.float32)
            for i in range(1, 30):
                worker.push([(0, 1, np.full(3, i, np.float32)), (1, 2, np.full(3, -i, np.float32))])
                future = worker.pull([(0, 1, out)])
                assert worker.wait_for(future, 10)
                future.result()
                assert out.tolist() == [2 * i] * 3, (i, out)
            return True

        assert on_threads(*(lambda w=w: rounds(w) for w in job.workers)) == [True, True]
