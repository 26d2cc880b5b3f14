"""The messages of an elastic job's joins and leaves, sent wrong by a member: a server and a worker
count them and go on (no freeze, no hang, no note relayed), and a worker cannot act as the scheduler.
In-process, on the inproc transport."""

import concurrent.futures
import time

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys, on_threads

from psnode.node.protocol import Cmd, pack_header, pack_json

pytestmark = pytest.mark.unit


@pytest.fixture
def job():
    settings = {"PSLAUNCH_MIN_WORKERS": "1"}  # elastic: 2 workers, at least 1
    with InProcJob(num_workers=2, num_servers=1, settings=settings, network_threads=False) as job:
        init_keys(job, {7: (0, np.zeros(4, np.float32))})
        yield job


def _a_round_still_closes(job) -> None:
    outs = [np.zeros(4, np.float32) for _ in job.workers]

    def step(worker, out):
        future = worker.push_part(0, 7, np.ones(4, np.float32))
        assert worker.wait_for(future, 10)
        pulled = worker.pull([(0, 7, out)])
        assert worker.wait_for(pulled, 10) and pulled.result() is None

    on_threads(*(lambda w=w, o=o: step(w, o) for w, o in zip(job.workers, outs)))
    assert all(out.tolist() == [2.0] * 4 for out in outs)


def _wait_malformed(node, at_least: int) -> None:
    deadline = time.monotonic() + 5
    while node.conn.link.malformed < at_least:
        assert time.monotonic() < deadline, f"{node.conn.link.malformed} malformed messages counted"
        time.sleep(0.01)


def test_a_malformed_leave_notice_or_a_forged_freeze_from_a_worker_is_counted_and_changes_nothing(job):
    worker, other, server = job.workers[0], job.workers[1], job.servers[0]
    to_server = server.conn.me.uid.encode()
    for frames in ([pack_header(Cmd.LEAVING)], [pack_header(Cmd.LEAVING), pack_json(["last"])],
                   [pack_header(Cmd.LEAVING), pack_json({"last": "soon"})], [pack_header(Cmd.LEAVING), b"\xff\x00"],
                   [pack_header(Cmd.JOIN_FREEZE)], [pack_header(Cmd.WORKER_JOINED), pack_json({"rank": 1})]):
        worker.conn.transport.send(to_server, frames)
    _wait_malformed(server, 6)
    assert server.joins.since is None and not server.joins.going  # not frozen, no leaver noted
    assert not other.elastic.going and worker.elastic.members_next() == (0, 1)
    _a_round_still_closes(job)


def test_a_malformed_join_or_leave_note_from_a_server_is_counted_by_the_worker_and_changes_nothing(job):
    worker, server = job.workers[0], job.servers[0]
    to_worker = worker.conn.me.uid.encode()
    for body in (["rank"], {"rank": 9, "start": 3, "version": 1, "provider": 0},
                 {"rank": 1, "start": "next", "version": 1, "provider": 0}):
        server.conn.transport.send(to_worker, [pack_header(Cmd.WORKER_JOINED), pack_json(body)])
    # a leave notice, then a lost worker's (its last round, the scheduler's change number) sent wrong
    for body in ({"rank": 1}, {"rank": -4, "last": 2}, {"rank": 1, "last": "soon", "lost": 1},
                 {"rank": 1, "last": 3, "lost": 0}, {"rank": 7, "last": None, "lost": 2}):
        server.conn.transport.send(to_worker, [pack_header(Cmd.LEAVING), pack_json(body)])
    deadline = time.monotonic() + 5
    while worker.conn.link.malformed < 8:  # this worker receives only while it waits
        worker.wait_for(concurrent.futures.Future(), 0.05)  # never done: receives for 50 ms
        assert time.monotonic() < deadline, worker.conn.link.malformed
    assert worker.elastic.members_next() == (0, 1) and not worker.elastic.owed and not worker.elastic.lost
    _a_round_still_closes(job)
