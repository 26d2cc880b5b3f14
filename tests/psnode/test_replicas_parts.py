"""The parts behind replicas and a scheduler started in place, each on its own: which server a
replica backs (``roster._replica_ranks``), a worker's book when a server is lost
(``Membership.server_lost``), the scheduler taking a job back (``Roster.take_back``, ``Comeback``)
and a connection's end seen by the transport (``gone``, ``dropped``), over real ZeroMQ sockets."""

import concurrent.futures
import dataclasses
import json
import os
import pickle
import time

import numpy as np
import pytest

import kvcore
from psnode.compression.codecs import RAW
from psnode.errors import ProtocolError, PSNodeError
from psnode.node.membership import Membership, PeerInfo
from psnode.node.protocol import FLAG_MIRROR, FLAG_SYNC, Cmd, pack_entries, pack_header, pack_json
from psnode.scheduler import comeback as comeback_mod
from psnode.scheduler.comeback import Comeback
from psnode.scheduler.roster import Barriers, Member, Roster, _replica_ranks
from psnode.server.checkpoints import Checkpoints
from psnode.server.marks import Mark
from psnode.server.node import ServerNode
from psnode.server.snapshot import read_snapshot, snapshot_frames
from psnode.server.store import ServerStore
from psnode.transport.base import Frame
from psnode.transport.zeromq import ZmqTransport
from testkit.inproc import InProcJob

pytestmark = pytest.mark.unit


def _peer(role, rank, host="10.0.0.1", port=4000, uid=None):
    return PeerInfo(role, rank, host, port, uid or f"{role}@{host}:{port}", "fp", "name")


def test_each_replica_backs_a_server_on_another_host_where_there_is_one():
    assert _replica_ranks(["a", "b"], ["a", "b"]) == [1, 0]  # the replica on a backs the server on b
    assert _replica_ranks(["a", "b", "c"], ["c", "a", "b"]) == [1, 2, 0]
    assert _replica_ranks(["a", "a"], ["a", "a"]) == [1, 0]  # one host: each server still gets one
    assert _replica_ranks(["a"], ["a"]) == [0]
    # two replicas a server: every rank gets two
    assert sorted(_replica_ranks(["a", "b"], ["a", "b", "a", "b"])) == [0, 0, 1, 1]


def test_a_lost_server_is_replaced_in_a_workers_book_by_its_replica():
    book = Membership("worker")
    nodes = [_peer("server", 0, port=1), _peer("server", 1, port=2), _peer("replica", 0, port=3),
             _peer("replica", 1, port=4)]
    connect = book.apply({"rank": 0, "nodes": [p.as_record() for p in nodes]})
    assert {p.port for p in connect} == {1, 2, 3, 4}  # a worker reaches servers and replicas
    book.server_lost(0, nodes[0].uid, nodes[2].uid)
    assert book.servers[0].uid == nodes[2].uid and book.servers[0].role == "server" and book.servers[0].rank == 0
    assert book.replicas[0] == [] and book.peers[nodes[2].uid.encode()].role == "server"
    assert nodes[0].uid.encode() not in book.peers
    book.server_lost(1, nodes[3].uid, None)  # a replica lost: its server stays
    assert book.servers[1].uid == nodes[1].uid and book.replicas[1] == []
    with pytest.raises(ProtocolError, match="which is no replica of it here"):
        book.server_lost(1, nodes[1].uid, "replica@elsewhere:9")


def test_a_book_naming_a_replica_of_a_server_the_job_does_not_have_is_refused():
    book = Membership("worker")
    with pytest.raises(ProtocolError, match="a replica of server 3, but the job has 1 servers"):
        book.apply({"rank": 0, "nodes": [_peer("server", 0).as_record(), _peer("replica", 3, port=5).as_record()]})


def _back(peer, **extra):
    return {**peer.as_record(), "rejoin": True, "job_id": "job", **extra}


def test_a_scheduler_started_in_place_takes_every_rank_back_and_counts_finished_workers(monkeypatch):
    monkeypatch.setattr(comeback_mod, "SETTLE", 0.05)
    roster = Roster(2, 1, job_id="job")
    back = Comeback()
    server, worker0, worker1 = _peer("server", 0, port=1), _peer("worker", 0, port=2), _peer("worker", 1, port=3)
    back.take(roster, server.uid.encode(), _back(server, finished={"1": "worker 1 on 10.0.0.1:3"},
                                                 barriers={"1": 4}))
    assert back.missing(roster) == ["worker 0"] and not back.over(roster, time.monotonic())
    back.take(roster, worker0.uid.encode(), _back(worker0, barriers={"1": 5}))
    assert back.missing(roster) == []
    assert not back.over(roster, time.monotonic())  # a moment more, for replicas
    time.sleep(0.06)
    assert back.over(roster, time.monotonic())
    assert back.completed == {1: 5}
    # the same node twice is taken once; a second node of a rank, another job's or a rank the job lacks is not
    assert back.take(roster, worker0.uid.encode(), _back(worker0)) is None
    with pytest.raises(PSNodeError, match="two workers came back with rank 0"):
        back.take(roster, b"worker@10.0.0.9:9", _back(_peer("worker", 0, host="10.0.0.9", port=9)))
    with pytest.raises(PSNodeError, match="of job 'other'"):
        back.take(roster, worker1.uid.encode(), {**_back(worker1), "job_id": "other"})
    with pytest.raises(ProtocolError, match="rank 7, not one of 0..1"):
        back.take(roster, b"worker@10.0.0.8:8", _back(_peer("worker", 7, host="10.0.0.8", port=8)))
    barriers = Barriers()
    back.close(roster, barriers)
    assert barriers.completed == {1: 5}
    assert not roster.all_workers_finished()  # worker 0 goes on; worker 1 finished and left
    for member in roster.members.values():
        if member.peer.role == "worker" and member.peer.rank == 0:
            member.finished = True
    assert roster.all_workers_finished()


def test_the_transport_sees_a_watched_connection_end_and_come_back():
    a, b = ZmqTransport(b"node-a"), ZmqTransport(b"node-b")
    try:
        port = b.bind(0, f"liveness-{os.getpid()}")
        a.connect(b"node-b", f"tcp://127.0.0.1:{port}")
        a.send(b"node-b", [b"hello"])
        assert b.poll(5)
        a.watch_liveness(b"node-b")
        assert a.gone(0.0) == [] and not a.dropped(b"node-b")
        b.close()
        deadline = time.monotonic() + 5
        while not a.dropped(b"node-b"):
            assert time.monotonic() < deadline, "the end of the connection was not seen"
            time.sleep(0.02)
        deadline = time.monotonic() + 5
        while a.gone(0.2) != [b"node-b"]:  # closed, and it stayed closed
            assert time.monotonic() < deadline, "the peer was not reported gone"
            time.sleep(0.02)
        assert a.gone(0.0) == []  # reported once
    finally:
        a.close()
        b.close()


def test_a_replicas_copy_of_a_push_that_overtakes_the_copy_of_its_init_waits_for_it():
    # the copies come by two sockets (worker 1's push, worker 0's init): a push of a key not here yet
    # is held, with every later copy of that worker, and taken in order once the init came
    job = InProcJob(2, 1, settings={"PSLAUNCH_SERVER_REPLICAS": "1"})
    replica = ServerNode(dataclasses.replace(job.env("server"), replica=True), transport=job.transport())
    w0, w1 = (PeerInfo("worker", r, "127.0.0.1", 7000 + r, f"worker@127.0.0.1:{7000 + r}", "fp", f"w{r}")
              for r in (0, 1))
    replica.conn.members.apply({"rank": 0, "nodes": [w0.as_record(), w1.as_record()]})
    key = 42

    def push(peer, seq, value):
        data = np.full(4, value, np.float32).tobytes()
        frames = [pack_header(Cmd.PUSH, seq, 1, FLAG_MIRROR), pack_entries([(key, 0, 0, RAW, 0, len(data), seq)]), data]
        replica._serve(peer, Cmd.PUSH, FLAG_MIRROR, seq, 1, [Frame(memoryview(f)) for f in frames])

    try:
        push(w1, 1, 1.0)
        push(w1, 2, 10.0)
        assert key not in replica.store.shards and len(replica._held_copies[1]) == 2
        spec = [{"key": key, "user_key": 7, "shape": [4], "dtype": "<f4", "frame": 0, "offset": 0, "row_size": 1}]
        init = [pack_header(Cmd.INIT, 1, 1, FLAG_SYNC | FLAG_MIRROR), pack_json(spec), np.zeros(4, np.float32).tobytes()]
        replica._serve(w0, Cmd.INIT, FLAG_SYNC | FLAG_MIRROR, 1, 1, [Frame(memoryview(f)) for f in init])
        shard = replica.store.shards[key]
        assert shard.round.received[1] == 2 and not replica._held_copies[1]
        push(w0, 1, 2.0)  # the first round closes with worker 1's first push, not its second
        assert shard.round.closed == 1 and np.array_equal(shard.stored, np.full(4, 3.0, np.float32))
        push(w0, 2, 20.0)
        assert shard.round.closed == 2 and np.array_equal(shard.stored, np.full(4, 30.0, np.float32))
    finally:
        replica.close()


def _answer(*args):
    pass


def test_a_servers_keys_travel_to_a_joining_replica_whole_and_checked():
    # a server mid-job: an open round with one push, a push held for the next round, the value before the
    # last round kept, momentum in the optimizer, a worker's marks; what the replica reads is the same
    store = ServerStore(num_workers=2)
    store.replay = store.replicated = True
    store.init(5, "w", np.arange(6, dtype=np.float32), sync=True, row_size=1)
    blob = pickle.dumps(kvcore.optim.Updater(kvcore.optim.SGD(learning_rate=0.1, momentum=0.9)))
    store.set_updater(pickle.loads(blob))
    shard = store.shards[5]
    for seq in (1, 2):  # two rounds closed: the updater ran twice, momentum is state
        for worker in (0, 1):
            store.push(shard, worker, np.full(6, seq + worker, np.float32), _answer, seq=seq)
    store.push(shard, 0, np.full(6, 7.0, np.float32), _answer, seq=3)  # the open round: worker 0's
    store.push(shard, 0, np.full(6, 8.0, np.float32), _answer, seq=4)  # held for the round after
    counts = np.zeros(1, [("key", "<u8"), ("seq", "<u8")])
    counts["key"], counts["seq"] = 5, 2
    store.add_mark(1, Mark(3, '{"step": 2}', counts, {"1": 0}, {}))
    store.finished[1] = "worker 1 on h:1"
    frames = snapshot_frames(store, blob, _updater_state(store), {1: {"threshold": 0.5}})

    got = read_snapshot([Frame(memoryview(np.ascontiguousarray(f).view(np.uint8) if not isinstance(f, bytes) else f))
                         for f in frames], 2, store.memory, versioned=True)
    (copy,) = got.shards
    assert (copy.key_id, copy.user_key, copy.shape) == (5, "w", (6,))
    assert np.array_equal(copy.stored, shard.stored)
    assert copy.round.closed == 2 and copy.round.received == [4, 2] and copy.round.count == 1
    assert copy.round.pushed == {0} and np.array_equal(copy.round.merge, np.full(6, 7.0, np.float32))
    assert [(w, d.tolist()) for w, d in copy.round.backlog] == [(0, [8.0] * 6)]
    assert copy.history.keys() == shard.history.keys() and all(
        np.array_equal(copy.history[v], shard.history[v]) for v in shard.history)
    assert copy.round.versioned
    assert got.updater_blob == blob and got.finished == {1: "worker 1 on h:1"} and got.codecs == [(1, {"threshold": 0.5})]
    ((worker, mark),) = got.marks
    assert (worker, mark.id, mark.count(5), mark.barriers) == (1, 3, 2, {"1": 0})
    momentum = got.state["keys"]["w"]["arrays"]
    assert len(momentum) == 1 and np.array_equal(momentum[0], store.updater.states["w"])

    # a field out of range is refused, naming it, before anything is taken
    index = json.loads(frames[0])
    index["shards"][0]["received"] = [1]
    bad = [Frame(memoryview(json.dumps(index).encode()))] + [Frame(memoryview(np.ascontiguousarray(f).view(np.uint8)))
                                                             for f in frames[1:]]
    with pytest.raises(ProtocolError, match="counts pushes of \\[1\\], not of 2 workers"):
        read_snapshot(bad, 2, store.memory, versioned=True)


def _updater_state(store):
    """The updater's state as a server sends it (``Checkpoints.updater_state``)."""
    return Checkpoints(store, None, None, 1, "job", lambda: 0, lambda: None).updater_state()


def test_a_replica_joining_a_running_job_backs_the_server_with_the_fewest_replicas_on_another_host():
    roster = Roster(1, 2, job_id="job", replicas=1)
    s0, s1 = _peer("server", 0, host="10.0.0.1", port=1), _peer("server", 1, host="10.0.0.2", port=2)
    r1 = _peer("replica", 1, host="10.0.0.1", port=3)
    for peer in (s0, s1, r1):
        roster.members[peer.uid.encode()] = Member({}, peer)
    late = _peer("replica", -1, host="10.0.0.2", port=4)
    member, (server_uid, server) = roster.join_replica(late.uid.encode(), {**late.as_record(), "job_id": "job"})
    assert (member.peer.rank, server.peer.uid) == (0, s0.uid) and member.info["late"] is True
    late2 = _peer("replica", -1, host="10.0.0.1", port=5)  # every server has one now: another host first
    member2, _ = roster.join_replica(late2.uid.encode(), {**late2.as_record(), "job_id": "job"})
    assert member2.peer.rank == 1
    with pytest.raises(ProtocolError, match="registered with job 'job'"):
        roster.join_replica(b"replica@10.0.0.9:9", {**_peer("replica", -1, host="10.0.0.9", port=9).as_record(),
                                                    "job_id": "other"})
    # when server 0 is lost, the replica there since the job began serves before one that joined later
    roster.members[b"replica@10.0.0.7:7"] = Member({}, _peer("replica", 0, host="10.0.0.7", port=7))
    taking = roster.server_lost(s0.uid.encode())
    assert taking.peer.uid == "replica@10.0.0.7:7" and taking.peer.role == "server"


def test_a_replica_that_answers_again_parts_a_lost_server_answered_completes_the_pull_with_the_rest():
    # a pull of two parts from server 0, whose rounds close one by one: the server answers part 0,
    # dies; the pull goes to its replica again, which answers both parts in one reply
    from psnode.worker.requests import RequestTable

    class Latch:
        error = None

    table = RequestTable(Latch())
    table.replicated = True
    outs = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    future = concurrent.futures.Future()
    req = table.track(future, 2, [memoryview(o).cast("B") for o in outs], "pull", (0, 0))
    pull = [pack_header(Cmd.PULL, req, 2), pack_entries([(7, 0, 0, RAW, 0, 16, 1), (8, 1, 0, RAW, 0, 16, 1)])]
    table.note_sent(req, 0, pull, mirrored=False)

    def reply(parts, value):
        payload = np.full(4 * len(parts), value, np.float32).tobytes()
        entries = [(7 + i, i, 0, RAW, 16 * n, 16, 0) for n, i in enumerate(parts)]
        return [Frame(memoryview(pack_header(Cmd.PULL_REPLY, req))), Frame(memoryview(pack_entries(entries))),
                Frame(memoryview(payload))]

    server, replica = _peer("server", 0, port=1), _peer("server", 0, port=3)
    table.take_reply(server, Cmd.PULL_REPLY, 0, req, 0, reply([0], 1.0))
    assert not future.done()
    assert table.server_lost(0) == [(req, pull)]  # sent again, to the replica
    table.take_reply(replica, Cmd.PULL_REPLY, 0, req, 0, reply([0, 1], 2.0))
    assert future.done() and future.exception() is None
    assert np.all(outs[0] == 1.0) and np.all(outs[1] == 2.0)  # part 0 as first answered, part 1 the replica's
