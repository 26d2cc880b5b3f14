"""The scheduler alone, on the in-process transport, talking to nodes the test plays itself."""

import threading

import pytest

from pscontract import contract_env, shared_job_id
from psnode.env import read_env
from psnode.errors import PeerDiedError, RegistrationTimeoutError
from psnode.node.membership import SCHEDULER
from psnode.node.protocol import FLAG_ERROR, Cmd, pack_header, pack_json, unpack_header, unpack_json
from psnode.scheduler.node import Scheduler
from psnode.scheduler.roster import Roster
from psnode.transport.inproc import InProcHub, InProcTransport

pytestmark = pytest.mark.unit

ROOT_PORT = 9


class FakeNode:
    """A node the test plays: registers with the scheduler and reads what it answers."""

    def __init__(self, hub, role, host="127.0.0.1", worker_id=None):
        self.transport = InProcTransport(b"", hub=hub)
        self.port = self.transport.bind(0)
        self.uid = f"{role}@{host}:{self.port}"
        self.transport.identity = self.uid.encode()
        self.info = {"role": role, "host": host, "port": self.port, "uid": self.uid, "fingerprint": "f",
                     "local_name": self.uid, "shm_probe": 0, "worker_id": worker_id, "pid": 1}
        self.transport.connect(SCHEDULER, f"tcp://127.0.0.1:{ROOT_PORT}")

    def send(self, cmd, req_id=0, arg=0, body=None):
        frames = [pack_header(cmd, req_id, arg)] + ([pack_json(body)] if body is not None else [])
        self.transport.send(SCHEDULER, frames)

    def register(self):
        self.send(Cmd.REGISTER, body=self.info)

    def expect(self, cmd, timeout=5.0):
        """The next message of command ``cmd`` (others, such as heartbeat acks, are skipped)."""
        while self.transport.poll(timeout):
            _, frames = self.transport.recv()
            got, flags, req_id, _ = unpack_header(frames[0])
            if got == cmd:
                return flags, req_id, (unpack_json(frames[1]) if len(frames) > 1 else None)
        raise AssertionError(f"no {Cmd(cmd).name} within {timeout} s")


class SchedulerThread:
    def __init__(self, workers, servers, **settings):
        self.hub = InProcHub()
        settings = {"PS_HEARTBEAT_INTERVAL": "0", "PSLAUNCH_REGISTER_TIMEOUT": "5", **settings}
        env = read_env(contract_env(role="scheduler", root_uri="127.0.0.1", root_port=ROOT_PORT, num_workers=workers,
                                    num_servers=servers, job_id="t", rank=0, local_rank=0, local_size=1,
                                    supervised=False, settings=settings))
        self.scheduler = Scheduler(env, transport=InProcTransport(SCHEDULER, hub=self.hub))
        self.result = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.result = self.scheduler.run()
        except BaseException as exc:
            self.result = exc

    def node(self, role, **kw):
        return FakeNode(self.hub, role, **kw)

    def join(self, timeout=5.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the scheduler did not end"
        return self.result


def registered(job, nodes):
    for node in nodes:
        node.register()
    return [node.expect(Cmd.ADDRBOOK)[2] for node in nodes]


def test_ranks_follow_worker_ids_then_host_and_port_and_each_node_gets_whom_it_must_reach():
    job = SchedulerThread(workers=3, servers=2)
    nodes = [job.node("worker", host="10.0.0.9"), job.node("worker", worker_id=0), job.node("worker", host="10.0.0.1"),
             job.node("server", host="10.0.0.5"), job.node("server", host="10.0.0.2")]
    books = registered(job, nodes)
    assert [book["rank"] for book in books] == [2, 0, 1, 1, 0]
    # a worker gets the servers (the workers on request: PEERS), a server the workers: O(nodes x servers) in all
    assert all([n["role"] for n in b["nodes"]] == ["server", "server"] and b["workers"] == "on-request" for b in books[:3])
    assert all([n["role"] for n in b["nodes"]] == ["worker"] * 3 and "workers" not in b for b in books[3:])
    ranks = {n["uid"]: n["rank"] for n in books[0]["nodes"] + books[3]["nodes"]}
    assert ranks == {n.uid: b["rank"] for n, b in zip(nodes, books)}
    nodes[0].send(Cmd.PEERS, 7)
    _, req_id, body = nodes[0].expect(Cmd.PEERS_REPLY)
    assert req_id == 7 and sorted(n["rank"] for n in body["nodes"]) == [0, 1, 2]
    nodes[3].send(Cmd.PEERS, 8)  # a server asks nothing of the kind: not answered
    for node in nodes[:3]:
        node.send(Cmd.FINISH, 1)
    for node in nodes[3:]:
        node.expect(Cmd.SHUTDOWN)
        node.send(Cmd.SHUTDOWN_ACK)
    assert job.join() == 0


def test_a_node_beyond_the_jobs_size_is_refused_naming_the_variable():
    job = SchedulerThread(workers=1, servers=1, PSLAUNCH_REGISTER_TIMEOUT="0.5")
    first, extra = job.node("server"), job.node("server", host="10.1.1.1")
    first.register()
    extra.register()
    _, _, body = extra.expect(Cmd.REGISTER_FAILED)
    assert "a server at 10.1.1.1" in body["error"] and "DMLC_NUM_SERVER=1" in body["error"]
    assert isinstance(job.join(), RegistrationTimeoutError)


def test_registration_timeout_names_what_is_missing_and_tells_the_nodes_that_came():
    job = SchedulerThread(workers=2, servers=1, PSLAUNCH_REGISTER_TIMEOUT="0.3")
    worker = job.node("worker")
    worker.register()
    _, _, body = worker.expect(Cmd.REGISTER_FAILED)
    assert "1 of 2 workers" in body["error"] and "missing: 1 server, 1 worker" in body["error"]
    error = job.join()
    assert isinstance(error, RegistrationTimeoutError) and "0 of 1 servers" in str(error)


def test_two_workers_asking_for_one_worker_id_are_refused_naming_both():
    job = SchedulerThread(workers=2, servers=1)
    nodes = [job.node("worker", host="10.0.0.1", worker_id=1), job.node("worker", host="10.0.0.2", worker_id=1),
             job.node("server")]
    for node in nodes:
        node.register()
    _, _, body = nodes[0].expect(Cmd.REGISTER_FAILED)
    assert "DMLC_WORKER_ID=1" in body["error"] and "10.0.0.1" in body["error"] and "10.0.0.2" in body["error"]
    assert "DMLC_WORKER_ID=1" in str(job.join())


def test_malformed_registrations_are_dropped_and_the_job_still_forms():
    job = SchedulerThread(workers=1, servers=1)
    stranger = job.node("worker")
    stranger.transport.send(SCHEDULER, [pack_header(Cmd.REGISTER), b"not json"])
    stranger.send(Cmd.REGISTER, body=["a", "list"])
    stranger.send(Cmd.REGISTER, body={**stranger.info, "uid": "someone-else"})
    stranger.send(Cmd.REGISTER, body={**stranger.info, "port": "no port"})
    stranger.send(Cmd.REGISTER, body={**stranger.info, "worker_id": "zero"})
    stranger.transport.send(SCHEDULER, [b"\x00garbage"])
    nodes = [job.node("worker"), job.node("server")]
    assert [book["rank"] for book in registered(job, nodes)] == [0, 0]
    assert job.scheduler.malformed == 6  # every one of them, the garbage frame too
    nodes[0].send(Cmd.FINISH, 1)
    nodes[1].expect(Cmd.SHUTDOWN)
    nodes[1].send(Cmd.SHUTDOWN_ACK)
    assert job.join() == 0


def test_barriers_answer_once_every_member_arrived_and_refuse_outsiders_and_unknown_groups():
    job = SchedulerThread(workers=2, servers=1)
    w0, w1, server = job.node("worker"), job.node("worker"), job.node("server")
    registered(job, [w0, w1, server])
    server.send(Cmd.BARRIER, 5, 1)  # group 1 is the workers'
    flags, req, body = server.expect(Cmd.BARRIER_DONE)
    assert flags & FLAG_ERROR and req == 5 and "not in the barrier group workers" in body["error"]
    w0.send(Cmd.BARRIER, 6, 99)
    assert "unknown barrier group 99" in w0.expect(Cmd.BARRIER_DONE)[2]["error"]
    w0.send(Cmd.BARRIER, 7, 1)
    assert not w0.transport.poll(0.05)  # waits for worker 1
    w1.send(Cmd.BARRIER, 8, 1)
    assert w0.expect(Cmd.BARRIER_DONE)[:2] == (0, 7) and w1.expect(Cmd.BARRIER_DONE)[:2] == (0, 8)
    for node in (w0, w1):
        node.send(Cmd.FINISH, 1)
    server.expect(Cmd.SHUTDOWN)
    server.send(Cmd.SHUTDOWN_ACK)
    assert job.join() == 0


def test_a_silent_node_is_announced_dead_to_the_others_naming_it():
    job = SchedulerThread(workers=1, servers=1, PS_HEARTBEAT_INTERVAL="0.05", PS_HEARTBEAT_TIMEOUT="0.3")
    worker, server = job.node("worker"), job.node("server", host="10.0.0.7")
    registered(job, [worker, server])
    body = None
    for _ in range(100):  # the worker keeps beating; the server says nothing
        worker.send(Cmd.HEARTBEAT)
        while body is None and worker.transport.poll(0.02):
            _, frames = worker.transport.recv()
            if unpack_header(frames[0])[0] == Cmd.NODE_DIED:
                body = unpack_json(frames[1])
        if body is not None:
            break
    assert body is not None, "no NODE_DIED within 2 s"
    assert body["role"] == "server" and body["rank"] == 0 and body["host"] == "10.0.0.7"
    assert "server 0 on 10.0.0.7" in body["message"] and "no heartbeat" in body["message"]
    error = job.join()
    assert isinstance(error, PeerDiedError) and error.role == "server"


def test_a_node_that_reports_its_own_failure_ends_the_job_with_its_reason():
    job = SchedulerThread(workers=2, servers=1)
    w0, w1, server = job.node("worker"), job.node("worker"), job.node("server")
    registered(job, [w0, w1, server])
    w1.send(Cmd.NODE_DIED, body={"message": "ValueError: bad batch"})
    for node in (w0, server):
        assert "failed: ValueError: bad batch" in node.expect(Cmd.NODE_DIED)[2]["message"]
    assert "ValueError: bad batch" in str(job.join())


@pytest.mark.parametrize("body", [{"message": 5}, "text", None])
def test_a_death_report_with_an_odd_body_still_ends_the_job_cleanly(body):
    job = SchedulerThread(workers=1, servers=1)
    worker, server = job.node("worker"), job.node("server")
    registered(job, [worker, server])
    worker.send(Cmd.NODE_DIED, body=body)
    assert "NODE_DIED" not in str(server.expect(Cmd.NODE_DIED)[2]["message"])
    assert isinstance(job.join(), PeerDiedError)


def test_a_node_whose_advertised_address_does_not_answer_is_found_with_why_and_same_host_peers_are_not_tried():
    import socket

    from psnode.node.membership import PeerInfo, unreachable

    with socket.create_server(("127.0.0.1", 0)) as listening, socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections to it are refused
        up = PeerInfo("server", 0, "127.0.0.1", listening.getsockname()[1], "s0", "elsewhere", "s0")
        down = PeerInfo("server", 1, "127.0.0.1", closed.getsockname()[1], "s1", "elsewhere", "s1")
        beside = PeerInfo("worker", 0, "127.0.0.1", closed.getsockname()[1], "w0", "here", "w0")
        assert unreachable([up, down, beside], "here", "shm", 5) == [(down, "Connection refused")]
        assert unreachable([beside], "here", "tcp", 5) == [(beside, "Connection refused")]


def test_a_node_that_derived_another_job_id_from_another_spelling_of_the_address_is_told_both_spellings():
    # a job started by hand without PSLAUNCH_JOB_ID: each process derives the id from the address it was given
    roster = Roster(num_workers=2, num_servers=0, job_id=shared_job_id("10.0.0.7", 9395), port=9395,
                    job_from="10.0.0.7:9395")
    info = {"role": "worker", "host": "10.0.0.8", "port": 4000, "uid": "worker@10.0.0.8:4000", "fingerprint": "f",
            "local_name": "n", "worker_id": None, "job_id": shared_job_id("node7", 9395), "job_from": "node7:9395"}
    why = roster.add(b"worker@10.0.0.8:4000", info)
    assert why == (f"a worker at 10.0.0.8:4000 derived job id {shared_job_id('node7', 9395)!r} from the scheduler "
                   f"address it was given, 'node7:9395', and this scheduler derived {roster.job_id!r} from "
                   "'10.0.0.7:9395': a job started without PSLAUNCH_JOB_ID needs every process to name the scheduler "
                   "alike (DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT), or PSLAUNCH_JOB_ID set alike in all")
    assert roster.missing("with the scheduler").endswith(f"missing: 2 workers; 1 registration refused, the first: {why}")


@pytest.mark.parametrize("spelling", ["localhost", "LOCALHOST", "::1", "127.0.0.1"])
def test_the_loopbacks_names_derive_one_job_id(spelling):
    assert shared_job_id(spelling, 9395) == shared_job_id("127.0.0.1", 9395) != shared_job_id("127.0.0.1", 9396)


def _record(role: str, rank: int, port: int, **extra) -> dict:
    uid = f"{role}@127.0.0.1:{port}"
    return {"role": role, "rank": rank, "host": "127.0.0.1", "port": port, "uid": uid, "fingerprint": "f",
            "local_name": "", "job_id": "j", **extra}


def test_a_scheduler_started_in_place_gives_nodes_whose_address_book_was_lost_the_ranks_the_others_have():
    # the scheduler before sent the books and died: worker 0 and server 1 got theirs, worker 1 and
    # server 0 did not, and register as at the start (no rank); they get the ranks the others' books hold
    from psnode.scheduler.comeback import Comeback
    from psnode.scheduler.roster import Roster

    roster, comeback = Roster(2, 2, "j"), Comeback()
    for info in (_record("worker", 0, 7000, rejoin=True, worker_id=0), _record("server", 1, 7003, rejoin=True)):
        comeback.take(roster, info["uid"].encode(), info)
    lost = {_record("worker", -1, 7001, worker_id=1)["uid"].encode(): _record("worker", -1, 7001, worker_id=1),
            _record("server", -1, 7002)["uid"].encode(): _record("server", -1, 7002)}
    assert comeback.missing(roster) == ["server 0", "worker 1"]
    for uid, info in lost.items():
        comeback.hold_unranked(roster, uid, info)
    taken = comeback.rank_unranked(roster)
    assert sorted((m.peer.role, m.peer.rank, m.peer.port) for _, m in taken) == [("server", 0, 7002),
                                                                                 ("worker", 1, 7001)]
    assert comeback.missing(roster) == [] and comeback.ranked == set(lost)
    assert comeback.rank_unranked(roster) == []  # each once


def test_servers_without_a_rank_wait_until_all_of_them_came_so_their_order_is_the_books():
    from psnode.scheduler.comeback import Comeback
    from psnode.scheduler.roster import Roster

    roster, comeback = Roster(1, 3, "j"), Comeback()
    comeback.take(roster, b"worker@127.0.0.1:7000", _record("worker", 0, 7000, rejoin=True, worker_id=0))
    comeback.hold_unranked(roster, b"server@127.0.0.1:7005", _record("server", -1, 7005))
    assert comeback.rank_unranked(roster) == []  # two server ranks are missing, one server came: not yet
    comeback.take(roster, b"server@127.0.0.1:7004", _record("server", 1, 7004, rejoin=True))
    taken = comeback.rank_unranked(roster)
    assert comeback.missing(roster) == ["server 0", "server 2"] and taken == []
    comeback.hold_unranked(roster, b"server@127.0.0.1:7003", _record("server", -1, 7003))
    taken = comeback.rank_unranked(roster)
    assert sorted((m.peer.port, m.peer.rank) for _, m in taken) == [(7003, 0), (7005, 2)]


# ---- an elastic job's joiners ---------------------------------------------------------------------
def _elastic(**settings):
    return SchedulerThread(workers=3, servers=1, PSLAUNCH_MIN_WORKERS="2", PSLAUNCH_START_WORKERS="2", **settings)


def test_a_joiner_waits_for_every_servers_round_then_gets_its_rank_start_round_and_the_providers_scalars():
    job = _elastic()
    w0, w1, server = job.node("worker"), job.node("worker"), job.node("server")
    assert [book["rank"] for book in registered(job, [w0, w1, server])] == [0, 1, 0]
    joiner = job.node("worker", host="10.0.0.9")
    joiner.register()
    server.expect(Cmd.JOIN_FREEZE)
    # what a server answers is checked: none of these moves the join on
    server.transport.send(SCHEDULER, [pack_header(Cmd.JOIN_ROUND), b"not json"])
    server.send(Cmd.JOIN_ROUND, body={"touched": -1, "unsettled": []})
    server.send(Cmd.JOIN_ROUND, body={"touched": 3, "unsettled": "all"})
    w0.send(Cmd.JOIN_ROUND, body={"touched": 99, "unsettled": []})  # a worker has no say
    assert not joiner.transport.poll(0.1)
    server.send(Cmd.JOIN_ROUND, body={"touched": 5, "unsettled": []})
    _, _, note = server.expect(Cmd.WORKER_JOINED)
    assert (note["rank"], note["start"], note["workers"], note["provider"]) == (2, 7, 3, 0)
    assert note["node"]["host"] == "10.0.0.9"
    _, _, book = joiner.expect(Cmd.ADDRBOOK)
    assert (book["rank"], book["joined"], book["free"]) == (2, 7, [])
    w1.send(Cmd.JOIN_SCALARS, body={"rank": 2, "start": 6, "scalars": {"step": 1}})  # the wrong round
    w0.send(Cmd.JOIN_SCALARS, body={"rank": 2, "start": 7, "scalars": {"step": 6}})
    _, _, scalars = joiner.expect(Cmd.JOIN_SCALARS)
    assert scalars == {"start": 7, "scalars": {"step": 6}}
    assert job.scheduler.malformed == 5
    # the job holds its maximum of 3 workers: the next one is refused, naming it, and the server thawed
    extra = job.node("worker", host="10.0.0.10")
    extra.register()
    server.expect(Cmd.JOIN_FREEZE)
    server.send(Cmd.JOIN_ROUND, body={"touched": 6, "unsettled": []})
    server.expect(Cmd.JOIN_THAW)
    _, _, body = extra.expect(Cmd.REGISTER_FAILED)
    assert "a worker at 10.0.0.10" in body["error"] and "its maximum of 3 workers (DMLC_NUM_WORKER" in body["error"]
    for node in (w0, w1, joiner):
        node.send(Cmd.FINISH, 1)
    server.expect(Cmd.SHUTDOWN)
    server.send(Cmd.SHUTDOWN_ACK)
    assert job.join() == 0


def test_a_left_rank_goes_to_a_joiner_once_no_server_holds_a_push_of_its_leaver_and_changes_are_numbered():
    job = _elastic()
    w0, w1, server = job.node("worker"), job.node("worker"), job.node("server")
    registered(job, [w0, w1, server])
    w1.send(Cmd.LEAVE, 4)
    _, _, left = server.expect(Cmd.WORKER_LEFT)
    assert w1.expect(Cmd.LEAVE_ACK)[1] == 4 and (left["rank"], left["version"]) == (1, 1)
    joiner = job.node("worker", host="10.0.0.9", worker_id=1)  # it asks for rank 1
    joiner.register()
    server.expect(Cmd.JOIN_FREEZE)
    server.send(Cmd.JOIN_ROUND, body={"touched": 8, "unsettled": [1]})  # worker 1's push is still in a round
    server.expect(Cmd.JOIN_THAW)
    server.expect(Cmd.JOIN_FREEZE)  # asked again a moment later
    server.send(Cmd.JOIN_ROUND, body={"touched": 9, "unsettled": [1]})
    server.expect(Cmd.JOIN_THAW)
    server.expect(Cmd.JOIN_FREEZE)
    server.send(Cmd.JOIN_ROUND, body={"touched": 9, "unsettled": []})
    _, _, note = server.expect(Cmd.WORKER_JOINED)
    assert (note["rank"], note["start"], note["version"], note["workers"]) == (1, 11, 2, 2)
    assert joiner.expect(Cmd.ADDRBOOK)[2]["free"] == [2]
    for node in (w0, joiner):
        node.send(Cmd.FINISH, 1)
    server.expect(Cmd.SHUTDOWN)
    server.send(Cmd.SHUTDOWN_ACK)
    assert job.join() == 0


def test_a_joiners_scalars_come_from_a_member_that_stays_and_another_is_asked_when_that_one_goes():
    job = SchedulerThread(workers=4, servers=1, PSLAUNCH_MIN_WORKERS="1", PSLAUNCH_START_WORKERS="3")
    w0, w1, w2, server = job.node("worker"), job.node("worker"), job.node("worker"), job.node("server")
    registered(job, [w0, w1, w2, server])
    joiner = job.node("worker", host="10.0.0.9")
    joiner.register()
    server.expect(Cmd.JOIN_FREEZE)
    server.send(Cmd.JOIN_ROUND, body={"touched": 4, "unsettled": [], "going": [0]})  # worker 0 announced its last push
    _, _, note = server.expect(Cmd.WORKER_JOINED)
    assert (note["rank"], note["provider"]) == (3, 1)  # not worker 0: it may leave before round 6 begins
    w1.send(Cmd.LEAVE, 9)  # worker 1 leaves after all (its step boundary came first): worker 2 is asked
    assert w1.expect(Cmd.LEAVE_ACK)[1] == 9
    _, _, asked = w2.expect(Cmd.JOIN_SCALARS)
    assert asked == {"rank": 3, "start": 6}
    w1.send(Cmd.JOIN_SCALARS, body={"rank": 3, "start": 6, "scalars": {"step": 5}})  # it owes none now
    w2.send(Cmd.JOIN_SCALARS, body={"rank": 3, "start": 6, "late": True})  # it had passed round 6 already
    _, _, body = joiner.expect(Cmd.JOIN_SCALARS)
    assert "was lost before it did" not in body.get("scalars", {}) and "had passed that round" in body["error"], body
    for node in (w0, w2, joiner):
        node.send(Cmd.FINISH, 1)
    server.expect(Cmd.SHUTDOWN)
    server.send(Cmd.SHUTDOWN_ACK)
    assert job.join() == 0
