"""The runtime's side of observability: counters in the parts, reports in heartbeats (checked by the
scheduler as untrusted input), the scheduler's stats line, clock probes and the timeline file."""

import json
import threading

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys

from pscontract import contract_env
from psnode.env import read_env
from psnode.errors import ProtocolError
from psnode.node.membership import SCHEDULER, PeerInfo
from psnode.node.protocol import Cmd, pack_header, pack_json, unpack_header, unpack_json
from psnode.node.stats import REPORT_LIMIT, check_report, server_report, worker_report
from psnode.node.timeline import Timeline
from psnode.scheduler.node import Member, Scheduler
from psnode.scheduler.report import JobReport
from psnode.transport.inproc import InProcHub, InProcTransport

pytestmark = pytest.mark.unit

ROOT_PORT = 9


class Node:
    """A node the test plays against a real scheduler on the inproc transport."""

    def __init__(self, hub, role, host="127.0.0.1"):
        self.transport = InProcTransport(b"", hub=hub)
        port = self.transport.bind(0)
        self.uid = f"{role}@{host}:{port}"
        self.transport.identity = self.uid.encode()
        self.info = {"role": role, "host": host, "port": port, "uid": self.uid, "fingerprint": "f",
                     "local_name": self.uid, "shm_probe": 0, "worker_id": None, "pid": 4242}
        self.transport.connect(SCHEDULER, f"tcp://127.0.0.1:{ROOT_PORT}")

    def send(self, cmd, req_id=0, body=None, raw=None):
        frames = [pack_header(cmd, req_id)]
        if body is not None:
            frames.append(pack_json(body))
        if raw is not None:
            frames.append(raw)
        self.transport.send(SCHEDULER, frames)

    def expect(self, cmd, timeout=5.0):
        while self.transport.poll(timeout):
            _, frames = self.transport.recv()
            got, _, req_id, _ = unpack_header(frames[0])
            if got == cmd:
                return req_id, (unpack_json(frames[1]) if len(frames) > 1 else None)
        raise AssertionError(f"no {Cmd(cmd).name} within {timeout} s")


def node_in(line, role="worker", host="127.0.0.1"):
    """The record of the node of ``role`` on ``host`` in a stats line ({} when it is not there yet)."""
    return next((n for n in line["nodes"] if n["role"] == role and n["host"] == host), {"s": {}, "state": ""})


@pytest.fixture
def supervised_scheduler():
    """A scheduler under pslaunch's settings (stats every 50 ms) whose stats lines the test reads."""
    hub = InProcHub()
    env = read_env(contract_env(role="scheduler", root_uri="127.0.0.1", root_port=ROOT_PORT, num_workers=2,
                                num_servers=1, job_id="t", rank=0, local_rank=0, local_size=1,
                                settings={"PS_HEARTBEAT_INTERVAL": "0", "PSLAUNCH_STATS": "0.05"}))
    scheduler = Scheduler(env, transport=InProcTransport(SCHEDULER, hub=hub))
    lines: list[dict] = []
    got_line = threading.Event()

    def keep(text):
        marker, _, body = text.partition(" ")
        assert marker == "\x1fPSLAUNCH-STATS"
        lines.append(json.loads(body))
        got_line.set()

    scheduler.job_report.stats._write = keep
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", scheduler.run()), daemon=True)
    thread.start()
    worker, other, server = Node(hub, "worker"), Node(hub, "worker", host="127.0.0.2"), Node(hub, "server")
    for node in (worker, other, server):
        node.send(Cmd.REGISTER, body=node.info)
    for node in (worker, other, server):
        node.expect(Cmd.ADDRBOOK)

    def next_line(predicate, timeout=5.0):
        for _ in range(int(timeout / 0.05) + 1):
            got_line.clear()
            if lines and predicate(lines[-1]):
                return lines[-1]
            got_line.wait(0.1)
        raise AssertionError(f"no stats line as expected; the last: {lines[-1] if lines else None}")

    yield scheduler, worker, server, next_line
    worker.send(Cmd.FINISH, 1)
    other.send(Cmd.FINISH, 1)
    server.expect(Cmd.SHUTDOWN)
    server.send(Cmd.SHUTDOWN_ACK)
    thread.join(5)
    assert result.get("code") == 0


def test_check_report_takes_the_known_counters_of_each_role_and_refuses_everything_else():
    assert check_report("worker", {"t": 1.5, "push_b": 10, "wait_s": 0.25}) == {"t": 1.5, "push_b": 10, "wait_s": 0.25}
    assert check_report("server", {"keys": 3, "updates": 7}) == {"keys": 3, "updates": 7}
    refused = [
        ("worker", ["t", 1], "not an object"),
        ("worker", {"keys": 3}, "unknown field 'keys'"),  # a server's counter from a worker
        ("server", {"push_b": "10"}, "push_b='10'"),
        ("server", {"push_b": True}, "push_b=True"),
        ("worker", {"wait_s": -1}, "wait_s=-1"),
        ("worker", {"t": float("nan")}, "t=nan"),
        ("worker", {"t": 2 ** 63}, "not a number in 0..2**62"),
        ("scheduler", {"t": 1}, "from a 'scheduler' node"),
    ]
    for role, body, words in refused:
        with pytest.raises(ProtocolError, match=None) as info:
            check_report(role, body)
        assert words in str(info.value), (body, str(info.value))


def test_the_scheduler_writes_each_nodes_latest_counters_state_and_heartbeat_age_in_its_stats_line(
        supervised_scheduler):
    scheduler, worker, server, next_line = supervised_scheduler
    worker.send(Cmd.HEARTBEAT, body={"s": {"t": 10.0, "lr": 0, "push_b": 4096, "pull_b": 2048, "rounds": 3,
                                           "wait_s": 0.5, "queued": 0, "cpu": 1.25, "rss": 1 << 20}})
    server.send(Cmd.HEARTBEAT, body={"s": {"t": 3.0, "lr": 0, "keys": 2, "held_b": 64, "push_b": 8192,
                                           "updates": 6, "waiting": 1}})
    line = next_line(lambda l: sum(1 for n in l["nodes"] if n["s"]) == 2)
    assert line["v"] == 1 and line["phase"] == "running" and line["self"]["pid"] > 0
    nodes = {(n["role"], n["host"]): n for n in line["nodes"]}
    assert nodes[("worker", "127.0.0.2")]["s"] == {}  # it sent no counters
    nodes = {n["role"]: n for n in line["nodes"] if n["host"] == "127.0.0.1"}
    assert nodes["worker"]["s"]["push_b"] == 4096 and nodes["worker"]["s"]["rounds"] == 3
    assert nodes["server"]["s"]["updates"] == 6 and nodes["server"]["s"]["waiting"] == 1
    assert nodes["worker"]["state"] == "running" and nodes["worker"]["pid"] == 4242
    assert all(0 <= n["age"] < 5 for n in line["nodes"])
    worker.send(Cmd.FINISH, 7, body={"s": {"t": 11.0, "lr": 0, "push_b": 8192, "rounds": 4}})  # the last counters
    line = next_line(lambda l: node_in(l)["state"] == "finished")
    assert node_in(line)["s"]["rounds"] == 4 and node_in(line, host="127.0.0.2")["state"] == "running"


def test_a_worker_that_died_and_waits_for_its_restart_is_listed_as_rejoining():
    env = read_env(contract_env(role="scheduler", root_uri="127.0.0.1", root_port=ROOT_PORT, num_workers=2,
                                num_servers=0, job_id="t", rank=0, local_rank=0, local_size=1,
                                settings={"PSLAUNCH_STATS": "0.05", "PSLAUNCH_RESTART_SCOPE": "worker"}))
    report, lines = JobReport(env, "boot:1"), []
    report.stats._write = lines.append
    peers = [PeerInfo("worker", r, "127.0.0.1", 5000 + r, f"w{r}", "f", f"w{r}", pid=10 + r) for r in range(2)]
    members = [Member({}, peers[0]), Member({}, peers[1], away_since=1.0)]
    report.registered()
    report.tell(members, at_once=True)
    nodes = json.loads(lines[-1].partition(" ")[2])["nodes"]
    assert [(n["rank"], n["state"]) for n in nodes] == [(0, "running"), (1, "rejoining")]


def test_a_malformed_heartbeat_body_is_counted_and_dropped_and_its_node_is_still_heard(supervised_scheduler):
    scheduler, worker, server, next_line = supervised_scheduler
    worker.send(Cmd.HEARTBEAT, body={"s": {"t": 1.0, "push_b": 100}})
    worker.expect(Cmd.HEARTBEAT_ACK)
    next_line(lambda l: node_in(l)["s"].get("push_b") == 100)
    bad_bodies = [
        {"raw": b"\xff not json"},
        {"raw": pack_json({"s": {"t": 2.0, "pad": "x" * REPORT_LIMIT}})},  # too big
        {"body": {"s": {"t": 2.0, "push_b": "a lot"}}},
        {"body": {"s": {"t": 2.0, "keys": 1}}},  # a server's field from a worker
        {"body": {"stats": {}}},
        {"body": {"clock": "now"}},
        {"body": [1, 2]},
    ]
    before = scheduler.malformed
    for number, bad in enumerate(bad_bodies, 10):
        worker.send(Cmd.HEARTBEAT, number, **bad)
        assert worker.expect(Cmd.HEARTBEAT_ACK)[0] == number  # answered all the same: it is alive
    assert scheduler.malformed == before + len(bad_bodies)
    line = next_line(lambda l: True)
    assert node_in(line)["s"] == {"t": 1.0, "push_b": 100}  # the last good one


def test_a_clock_probe_is_answered_with_the_schedulers_clock_and_boot_id(supervised_scheduler):
    scheduler, worker, _, _ = supervised_scheduler
    worker.send(Cmd.HEARTBEAT, 3, body={"clock": 123456789})
    _, body = worker.expect(Cmd.HEARTBEAT_ACK)
    assert body["clock"] == 123456789 and isinstance(body["now"], int)
    assert body["boot"] == scheduler.fingerprint.split(":")[0]


def test_the_clock_offset_comes_from_the_shortest_round_trip_and_is_exact_on_the_schedulers_host():
    timeline = Timeline("worker", 1, 2, sink=None)
    timeline.clock_sample(1000, 50_600, 2000, same_boot=False)  # round trip 1000 ns: offset 49 100
    timeline.clock_sample(3000, 52_000, 3200, same_boot=False)  # round trip 200 ns: offset 48 900 wins
    timeline.clock_sample(4000, 99_999, 9000, same_boot=False)  # slower: ignored
    assert timeline.offset_ns == 48_900 and "round trip 0.2 us" in timeline.clock_note
    timeline.clock_sample(0, 77_000, 10, same_boot=True)
    assert timeline.offset_ns == 0 and "host clock" in timeline.clock_note


def test_workers_and_servers_count_what_they_push_pull_merge_and_update():
    with InProcJob(num_workers=2, num_servers=1) as job:
        init_keys(job, {7: (0, np.zeros(16, np.float32))})
        for _ in range(3):
            futures = [w.push([(0, 7, np.ones(16, np.float32))]) for w in job.workers]
            outs = [np.empty(16, np.float32) for _ in job.workers]
            pulls = [w.pull([(0, 7, out)]) for w, out in zip(job.workers, outs)]
            for worker, future in zip(job.workers, futures + pulls):
                assert worker.wait_for(future, 10)
            for worker, future in zip(job.workers, pulls):
                assert worker.wait_for(future, 10)
        for worker in job.workers:
            requests = worker.requests
            assert (requests.pushed_bytes, requests.pulled_bytes, requests.rounds) == (3 * 64, 3 * 64, 3)
            report = worker_report(worker)
            assert check_report("worker", report) == report  # what a worker reports passes the scheduler
            assert report["push_b"] == 192 and report["queued"] == 0
        store = job.servers[0].store
        assert (store.pushed_bytes, store.updates, store.held_bytes) == (6 * 64, 3, 64)
        report = server_report(job.servers[0])
        assert check_report("server", report) == report and report["keys"] == 1 and report["waiting"] == 0


def test_allreduce_workers_report_the_bytes_they_summed_as_pushed_and_pulled_and_their_collectives_as_rounds():
    with InProcJob(num_workers=2, num_servers=0) as job:
        steps = [("w", np.ones(16, np.float32))] * 3 + [("b", np.ones(4, np.float64))]  # 3 x 64 bytes, 1 x 32
        for key, value in steps:
            futures = [w.collectives.allreduce(key, value.copy()) for w in job.workers]
            for worker, future in zip(job.workers, futures):
                assert worker.wait_for(future, 10), f"worker {worker.rank}'s allreduce of {key!r} did not end in 10 s"
        for worker in job.workers:
            report = worker_report(worker)
            assert check_report("worker", report) == report
            assert (report["push_b"], report["pull_b"], report["rounds"]) == (3 * 64 + 32, 3 * 64 + 32, 3)


def test_a_job_started_by_hand_appends_every_nodes_events_to_one_timeline_file_that_ends_as_json(tmp_path):
    path = tmp_path / "trace.json"
    with InProcJob(num_workers=2, num_servers=1, settings={"PSLAUNCH_TIMELINE": str(path)}) as job:
        init_keys(job, {7: (0, np.zeros(4, np.float32))})
        for worker in job.workers:
            assert worker.wait_for(worker.push([(0, 7, np.ones(4, np.float32))]), 10)
    events = json.loads(path.read_text())  # the scheduler ended the array: the job ended in order
    names = {(e["pid"], e["name"].split()[0]) for e in events if e["ph"] == "X"}
    # one process per node: 1 the scheduler, 2 the server, 3 and 4 the workers
    assert {(1, "registration"), (1, "barrier"), (2, "register"), (2, "merge"), (2, "update"), (3, "wait"),
            (4, "wait")} <= names, names
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes[1].startswith("scheduler") and processes[2].startswith("server 0")
    assert processes[3].startswith("worker 0") and processes[4].startswith("worker 1")
