"""A worker started again alone (PSLAUNCH_RESTART_SCOPE=worker) gets its address book while each
server gets WORKER_REJOINED: both leave the scheduler at once, so the worker's first request can
reach a server first. The server's connection keeps such messages until the notice names their
sender (a replacement's MARKS once went unanswered for 60 s), and counts what an unknown sender
sends beyond a bound as malformed. The real Connection, on the in-process transport."""

from __future__ import annotations

import pytest

from psnode.node.connection import _EARLY_LIMIT, Connection
from psnode.node.membership import SCHEDULER, PeerInfo
from psnode.node.protocol import Cmd, pack_header, pack_json
from testkit.inproc import InProcJob

pytestmark = pytest.mark.unit


def worker(rank: int, port: int) -> PeerInfo:
    return PeerInfo("worker", rank, "127.0.0.1", port, f"worker@127.0.0.1:{port}", "fp", f"w{port}")


def server_connection(scope: str):
    job = InProcJob(2, 1, settings={"PSLAUNCH_RESTART_SCOPE": scope})
    got = []
    conn = Connection(job.env("server"), "server", lambda peer, cmd, *rest: got.append((peer.uid, Cmd(cmd).name)),
                      transport=job.transport())
    old0, old1 = worker(0, 1000), worker(1, 1001)
    book = {"rank": 0, "nodes": [conn.me.as_record(), old0.as_record(), old1.as_record()]}
    conn.members.apply(book)
    return conn, got, old1


def rejoined(old: PeerInfo, new: PeerInfo) -> list:
    return [pack_header(Cmd.WORKER_REJOINED), pack_json({"old": old.uid, "node": new.as_record()})]


def test_a_replacements_request_that_comes_before_the_schedulers_notice_is_handled_once_the_notice_came():
    conn, got, old1 = server_connection("worker")
    try:
        new1 = worker(1, 2001)
        conn.dispatch(new1.uid.encode(), [pack_header(Cmd.MARKS, 7, 1)])
        conn.dispatch(old1.uid.encode(), [pack_header(Cmd.PULL, 8)])  # the predecessor's: a known sender
        assert got == [(old1.uid, "PULL")] and conn.link.malformed == 0
        conn.dispatch(SCHEDULER, rejoined(old1, new1))
        assert got == [(old1.uid, "PULL"), (new1.uid, "MARKS")]
        conn.dispatch(new1.uid.encode(), [pack_header(Cmd.PULL, 9)])  # known now: at once
        assert got[-1] == (new1.uid, "PULL") and conn.link.malformed == 0
    finally:
        conn.close(linger=0)


def test_what_an_unknown_sender_sends_is_kept_within_a_bound_and_not_at_all_without_the_worker_scope():
    conn, got, old1 = server_connection("worker")
    try:
        stranger = b"worker@127.0.0.1:3000"
        for i in range(_EARLY_LIMIT + 3):
            conn.dispatch(stranger, [pack_header(Cmd.PULL, i)])
        assert got == [] and conn.link.malformed == 3  # beyond the bound: counted and dropped
        conn.dispatch(SCHEDULER, rejoined(old1, worker(1, 2001)))  # another worker's notice
        assert got == []  # still kept: its own notice may be on the way
        conn.dispatch(b"server@127.0.0.1:4000", [pack_header(Cmd.PULL, 1)])  # not a worker's identity
        assert conn.link.malformed == 4
    finally:
        conn.close(linger=0)
    conn, got, _ = server_connection("job")
    try:
        conn.dispatch(b"worker@127.0.0.1:3000", [pack_header(Cmd.PULL, 1)])
        assert got == [] and conn.link.malformed == 1
    finally:
        conn.close(linger=0)
