"""Servers that do not lose state (``--server-replicas K``): each server's keys are also held by a
replica, a server process of its own that the workers feed round for round; when a server's process
is killed, its replica serves in its place and the job goes on, with the weights an uninterrupted run
ends with, bit for bit. Nothing is restarted: every other process keeps its pid.

The model of tests/launcher/helpers/replace_sync.py: its gradients depend on the weights each worker
pulled, so the final weights are equal only when the replica took every push exactly once and
answered every pull with the value after the round it named.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from launcher import launch
from testkit.launcher import backend_launch, helper, job_server, live_processes, reaped, run_pslaunch, wait_gone
from testkit.launcher.outcome import ended_like, same_weights, saved_weights, table_rows
from testkit.launcher.processes import StderrWatch, start_pslaunch

HELPER = helper("replace_sync.py")
ENV = ["--env", "PSLAUNCH_BIGARRAY_BOUND:1000"]  # key 0 is split over both servers
STEPS = 200

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The weights of an uninterrupted run without replicas."""
    out = tmp_path_factory.mktemp("uninterrupted")
    res = run_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, "--env", f"STEPS:{STEPS}", "--timeout", "100",
                        "python", HELPER, str(out)], timeout=120)
    assert res.returncode == 0, res.stderr
    return saved_weights(out)


def _holders(pslaunch_pid: int) -> dict[str, list[int]]:
    """The job's live server processes (children of pslaunch): ``{"server": [pids], "replica": [pids]}``."""
    found: dict[str, list[int]] = {"server": [], "replica": []}
    for proc in live_processes():
        if proc.ppid == pslaunch_pid and b"psnode" in proc.argv and b"server" in proc.argv:
            kind = "replica" if proc.environ().get(b"PSLAUNCH_SERVER_REPLICA") == b"1" else "server"
            found[kind].append(proc.pid)
    return found


def _start(out, *extra, steps=STEPS, env=()):
    env_args = [a for item in env for a in ("--env", item)]
    return start_pslaunch(["-n", "2", "-s", "2", "--server-replicas", "1", "--no-dashboard", *ENV,
                           "--env", f"STEPS:{steps}", "--env", "STEP_SLEEP:0.01", *env_args, *extra,
                           "--timeout", "150", "python", HELPER, str(out)])


def _running(out, proc, seconds=1.0):
    """Wait until both workers started and trained ``seconds``."""
    deadline = time.monotonic() + 40
    while not (out / "starts.txt").exists() or len((out / "starts.txt").read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
        time.sleep(0.05)
    time.sleep(seconds)
    assert proc.poll() is None, "the job ended before the kill"


@pytest.mark.parametrize("victims", [("server",), ("replica",), ("server", "worker")],
                         ids=["a-server", "a-replica", "a-server-and-a-worker"])
def test_a_killed_server_is_served_by_its_replica_and_the_weights_are_bit_equal(tmp_path, reference, victims):
    extra = ["--max-restarts", "2", "--restart-scope", "worker"] if "worker" in victims else []
    proc = _start(tmp_path, *extra)
    with reaped(proc, str(tmp_path)):
        _running(tmp_path, proc)
        holders = _holders(proc.pid)
        assert len(holders["server"]) == 2 and len(holders["replica"]) == 2, holders
        before = {p.pid for p in live_processes() if p.ppid == proc.pid}
        killed = [holders[victims[0]][0]]
        if "worker" in victims:  # the other kind of failure in the same job: a worker replaced in place
            killed.append(next(p.pid for p in live_processes() if p.ppid == proc.pid and HELPER.encode() in p.argv))
        for pid in killed:
            subprocess.run(["kill", "-9", str(pid)], check=True)
        _, err = proc.communicate(timeout=160)
    stderr = err.decode()
    ended_like(proc.returncode, stderr, tmp_path, reference)
    rows = table_rows(stderr)
    # no process but the killed ones ended otherwise than with 0, and every process that ran is one that ran
    # before the kill (nothing restarted), except a replaced worker's replacement
    assert sorted(int(r[2]) for r in rows if r[3] == "signal SIGKILL") == sorted(killed), rows
    assert all(r[3] == "0" for r in rows if int(r[2]) not in killed), rows
    new = {int(r[2]) for r in rows} - before
    # with restarts (--restart-scope worker) the worker is replaced, and the server comes back as a replica
    assert len(new) == (2 if "worker" in victims else 0), (rows, before)
    if victims[0] == "server":
        assert re.search(r"scheduler: server \d on \S+ \(pid \d+\) is gone: its connection closed and stayed closed "
                         r"for 0\.3 s; replica \S+ holds its keys and serves as server \d from now on", stderr), stderr
        note = "failed; restarted alone" if "worker" in victims else "failed; a replica took its place"
        assert [r[4] for r in rows if int(r[2]) == killed[0]] == [note], rows
    else:
        assert re.search(r"replica \d on \S+ \(pid \d+\) is gone: .*; server \d goes on without this replica", stderr)
        assert [r[4] for r in rows if int(r[2]) == killed[0]] == ["failed; its server went on"], rows
    said = ("restarting it alone as a replica" if "worker" in victims
            else r"the job goes on \(--server-replicas 1: ")
    assert re.search(rf"pslaunch: (server|replica)\.\d@\S+ \(.*\) failed: signal SIGKILL; {said}", stderr), stderr


def test_a_server_whose_replicas_are_lost_too_ends_the_job_naming_it(tmp_path):
    proc = _start(tmp_path, steps=3000)
    with reaped(proc, str(tmp_path)):
        _running(tmp_path, proc, 0.5)
        holders = _holders(proc.pid)
        for pid in holders["replica"]:  # each server goes on without its replica
            subprocess.run(["kill", "-9", str(pid)], check=True)
        time.sleep(1.0)
        assert proc.poll() is None, "the job ended when the replicas were lost"
        subprocess.run(["kill", "-9", str(holders["server"][0])], check=True)
        _, err = proc.communicate(timeout=60)
    stderr = err.decode()
    assert not wait_gone(str(tmp_path))
    assert proc.returncode == 137, stderr  # the server's end, not a --timeout
    assert re.search(rf"root cause: server\.\d@\S+ \(server rank \d on \S+, pid {holders['server'][0]}\) failed first: "
                     r"signal SIGKILL", stderr), stderr
    assert re.search(r"ended because a peer failed: server \d on \S+ \(pid \d+\) is gone: its connection closed and "
                     r"stayed closed for 0\.3 s; no replica of its keys is left \(--server-replicas\), so the job cannot "
                     r"go on", stderr), stderr


def test_replicas_are_in_the_plan_and_the_run_result(tmp_path):
    # the Python API, as a user calls it: the replicas are processes of the job, with the contract's variables
    result = launch([sys.executable, HELPER, str(tmp_path)], num_workers=2, num_servers=2, server_replicas=1,
                    dry_run=True)
    assert "replica.0@localhost" in result.plan and "replica.1@localhost" in result.plan, result.plan
    plan = result.plan.split("replica.0@localhost", 1)[1]
    assert "PSLAUNCH_SERVER_REPLICA=1" in plan and "DMLC_ROLE=server" in plan, result.plan
    assert result.plan.count("PSLAUNCH_SERVER_REPLICAS=1") == 7, result.plan  # every process of the job
    result = launch([sys.executable, HELPER, str(tmp_path)], num_workers=2, num_servers=2, server_replicas=1,
                    timeout=60, env={"PSLAUNCH_BIGARRAY_BOUND": "1000", "STEPS": "5"})
    assert result.ok, result.root_cause
    assert sorted(p.name for p in result.processes if p.role == "replica") == ["replica.0@localhost",
                                                                               "replica.1@localhost"]
    assert all(p.exit_code == 0 for p in result.processes), result.processes


@pytest.mark.parametrize("args, message", [
    (["-s", "0", "--server-replicas", "1"], "--server-replicas 1 keeps copies of the servers' keys, but -s 0 starts "
                                            "no servers"),
    (["--server-replicas", "9"], "--server-replicas must be between 0 and 8, got 9"),
    (["--launcher", "mpi", "--server-replicas", "1"], "--server-replicas is not an option of --launcher mpi: one mpirun"),
])
def test_replicas_where_they_cannot_work_are_refused_before_anything_starts(tmp_path, args, message):
    res = run_pslaunch(["-n", "2", *args, "--dry-run", "python", HELPER, str(tmp_path)], timeout=30)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr, res.stderr


def test_a_dist_async_key_is_refused_with_replicas_naming_why(tmp_path):
    res = run_pslaunch(["-n", "2", "-s", "1", "--server-replicas", "1", "--no-dashboard", *ENV, "--env",
                        "STORE:dist_async", "--env", "STEPS:2", "--timeout", "60", "python", HELPER, str(tmp_path)],
                       timeout=90)
    assert res.returncode != 0, res.stderr
    assert "of a dist_async store cannot be replicated: replicas (--server-replicas, PSLAUNCH_SERVER_REPLICAS) hold " \
           "dist_sync and dist_device_sync keys" in res.stderr, res.stderr
    assert not wait_gone(str(tmp_path))


def test_checkpoints_go_on_after_a_replica_took_a_servers_place(tmp_path, reference):
    # the replica writes the lost server's part of each later commit; the last checkpoint is whole
    ckpt = tmp_path / "ckpt"
    proc = _start(tmp_path, "--checkpoint-dir", str(ckpt), env=["COMMIT_EVERY:20"])
    with reaped(proc, str(tmp_path)):
        _running(tmp_path, proc)
        subprocess.run(["kill", "-9", str(_holders(proc.pid)["server"][0])], check=True)
        _, err = proc.communicate(timeout=160)
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    assert same_weights(saved_weights(tmp_path), reference)
    restored = tmp_path / "restored"
    restored.mkdir()
    # a new job that restores the last commit (step 200) has nothing left to train: its weights are the same
    res = run_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, "--env", f"STEPS:{STEPS}", "--env", "COMMIT_EVERY:20",
                        "--checkpoint-dir", str(ckpt), "--timeout", "60", "python", HELPER, str(restored)], timeout=90)
    assert res.returncode == 0, res.stderr
    assert open(restored / "starts.txt").read().split() == ["0", "0", str(STEPS), "1", "0", str(STEPS)] or \
        sorted(open(restored / "starts.txt").read().splitlines()) == [f"0 0 {STEPS}", f"1 0 {STEPS}"]
    assert same_weights(saved_weights(restored), reference)


def test_a_server_killed_on_its_host_over_ssh_is_served_by_a_replica_on_the_other_host(request, tmp_path, reference):
    # servers and replicas on 127.0.0.2 and 127.0.0.3, each replica given the keys of the server on the other host
    launch_ = backend_launch("ssh", request, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    proc = launch_.start(["-n", "2", "-s", "2", "--server-replicas", "1", "--no-dashboard", *launch_.args, *ENV,
                          "--env", f"STEPS:{STEPS}", "--env", "STEP_SLEEP:0.01", "--env", f"PSLAUNCH_BENCH_TAG:{out}",
                          "--timeout", "150", sys.executable, HELPER, str(out)])
    with reaped(proc, str(out)):
        _running(out, proc)
        server = job_server(str(out))
        assert server is not None
        subprocess.run(["kill", "-9", str(server)], check=True)
        _, err = proc.communicate(timeout=160)
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    assert same_weights(saved_weights(out), reference), "the weights differ from the uninterrupted run's"
    took = re.search(r"server \d on ([\d.]+):\d+ \(pid \d+\) is gone: .*; replica replica@([\d.]+):\d+ holds its keys "
                     r"and serves as server \d from now on", stderr)
    assert took, stderr
    assert took.group(1) != took.group(2), took.group(0)  # the replica was on the other host: a lost host loses nothing
    rows = table_rows(stderr)
    # the remote guard reports the signal the shell's way; every other process ended well, none was restarted
    assert [(r[0], r[3], r[4]) for r in rows if r[3] != "0"] == [("server", "137 (128+SIGKILL)",
                                                                  "failed; a replica took its place")], rows
    assert len(rows) == 7, rows
    assert not wait_gone(str(out))


def test_a_lost_server_comes_back_as_a_replica_and_takes_a_second_loss_exactly(tmp_path):
    # with restarts, the killed server is started again as a replica and gets its rank's keys from the
    # server in its place; then both original replicas are killed, the one serving that rank among them:
    # the newcomer serves it, so the job ends with the uninterrupted weights only if the keys it got were exact
    steps = 400
    reference_out = tmp_path / "reference"
    reference_out.mkdir()
    res = run_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, "--env", f"STEPS:{steps}", "--timeout", "100",
                        "python", HELPER, str(reference_out)], timeout=120)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(out, "--max-restarts", "5", "--restart-scope", "worker", steps=steps)
    with reaped(proc, str(out)):
        watch = StderrWatch(proc)
        _running(out, proc, 0.5)
        holders = _holders(proc.pid)
        subprocess.run(["kill", "-9", str(holders["server"][0])], check=True)
        # the server comes back as a replica and takes its keys: then the second loss
        took = watch.wait_for(r"replica of server \d took that server's \d+ keys", 60)
        assert took and proc.poll() is None, f"the job ended before the second loss:\n{watch.text()}"
        for pid in holders["replica"]:
            subprocess.run(["kill", "-9", str(pid)], check=True)
        stderr = watch.finish(160)
    ended_like(proc.returncode, stderr, out, saved_weights(reference_out))
    assert re.search(r"joined the job as a replica of server \d", stderr), stderr
    assert re.search(r"replica of server \d took that server's \d+ keys", stderr), stderr
    assert stderr.count("holds its keys and serves as server") == 2, stderr
    assert re.search(r"pslaunch: server\.\d@\S+ replaced in place at [\d.]+ s \(signal SIGKILL; .*\): a replica again, "
                     r"holding its server's keys [\d.]+ s after the end", stderr), stderr
