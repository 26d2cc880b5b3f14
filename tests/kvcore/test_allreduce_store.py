"""The allreduce store and kvcore.collectives end to end: a job without servers, real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from kvcore_testkit import run_job_ok

from testkit import LocalJob

SCRIPTS = Path(__file__).parent / "allreduce_scripts"
FAST_HEARTBEATS = {"PS_HEARTBEAT_INTERVAL": "0.2", "PS_HEARTBEAT_TIMEOUT": "2"}


def run_ok(name: str, workers: int, env: dict | None = None, timeout: float = 90) -> list:
    return run_job_ok([str(SCRIPTS / name)], workers, 0, env, timeout)


@pytest.mark.parametrize("workers,same_host", [(2, "shm"), (3, "tcp"), (4, "shm")])
def test_the_allreduce_store_has_kvstore_semantics_with_exact_sums(workers, same_host):
    results = run_ok("store_sums.py", workers, {"PSLAUNCH_SAME_HOST": same_host})
    assert [r.returncode for r in results if r.role == "scheduler"] == [0]  # no servers: it ends on its own


def test_with_a_timeline_each_workers_calls_of_the_allreduce_store_are_events_named_by_their_key(tmp_path):
    trace = tmp_path / "trace.json"
    run_ok("store_sums.py", 2, {"PSLAUNCH_TIMELINE": str(trace)})
    events = json.loads(trace.read_text())  # the scheduler ended the array: the job ended in order
    calls = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X"}  # a call's event: "push w"
    workers = {pid for pid, name in calls if name == "pushpull big"}
    assert len(workers) == 2, sorted(calls)
    for pid in workers:
        assert {(pid, "init w"), (pid, "push w"), (pid, "pull w"), (pid, "pushpull small"), (pid, "wait")} <= calls


@pytest.mark.parametrize("same_host", ["shm", "tcp"])
def test_collectives_give_exact_results_for_every_call_form(same_host):
    run_ok("collectives_calls.py", 3, {"PSLAUNCH_SAME_HOST": same_host})


def test_a_worker_that_finishes_before_a_slow_peer_read_its_last_messages_still_delivers_them():
    # A finished worker closed its connections at once, dropping what still waited in its queues
    # behind a peer that reads slowly (the allreduce benchmark, 4 workers on 2 cores: that peer failed
    # with "worker 0 finished the job while ... still waits for it").
    results = run_ok("late_reader.py", 2, timeout=60)
    said = [r for r in results if "FINISHING WHILE WORKER 1 IS STOPPED" in r.output]  # by rank 0, whichever process
    assert len(said) == 1, "\n".join(map(str, results))


@pytest.mark.parametrize("workers,same_host,lanes", [(3, "tcp", "on"), (4, "tcp", "on"), (2, "tcp", "off"),
                                                     (2, "shm", "on")])
def test_big_segments_to_workers_reached_over_tcp_travel_on_lanes_and_every_sum_is_exact(workers, same_host, lanes):
    results = run_ok("lane_sums.py", workers, {"PSLAUNCH_SAME_HOST": same_host, "PSLAUNCH_LANES": lanes})
    counts = [int(c) for r in results for c in re.findall(r"^OK \d+ lane messages (\d+)$", r.output, re.M)]
    assert len(counts) == workers, "\n".join(map(str, results))
    if same_host == "tcp" and lanes == "on":
        assert min(counts) > 0, counts
    else:  # lanes off, or every peer on the same-host path: nothing takes a lane
        assert counts == [0] * workers, counts


def test_pushes_started_in_different_orders_by_the_workers_meet_by_key_and_version():
    run_ok("reordered.py", 3, {"PSLAUNCH_SAME_HOST": "tcp"})


def test_workers_that_init_different_shapes_all_raise_a_mismatch_naming_both_then_go_on():
    results = run_ok("mismatch.py", 3)
    lines = [m for r in results for m in re.findall(r"^MISMATCH \d: (.*)$", r.output, re.M)]
    assert len(lines) == 3, "\n".join(map(str, results))
    assert all("5 elements" in line or "(5,)" in line for line in lines), lines


def test_a_dist_store_in_a_job_without_servers_points_to_the_allreduce_store(tmp_path):
    script = tmp_path / "dist.py"
    script.write_text("import kvcore\nkvcore.create('dist_sync')\n")
    with LocalJob(1, 0, worker=[str(script)], start_scheduler=False) as job:  # it fails before it connects
        result = [r for r in job.wait(60) if r.role == "worker"][0]
    assert result.returncode == 1
    assert "DMLC_NUM_SERVER=0" in result.output and "kvcore.create('allreduce')" in result.output, result.output


def _wait_ready(job: LocalJob, workers: int, timeout: float = 60, line: str = "READY") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(line in job.output_of("worker", i) for i in range(workers)):
            return
        time.sleep(0.05)
    raise AssertionError("\n".join(str(r) for r in job.results()))


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_or_stopped_worker_makes_every_other_fail_naming_it_within_the_heartbeat_timeout(how):
    with LocalJob(3, 0, worker=[str(SCRIPTS / "loop.py")], env=FAST_HEARTBEATS) as job:
        _wait_ready(job, 3, line="RUNNING")  # every worker ran a few rounds
        victim = job.of("worker", 2)
        os.kill(victim.pid, how)
        for i in (0, 1):  # within 20 s, 10 times the heartbeat timeout (2 s)
            job.of("worker", i).wait(20)
        results = {r.index: r for r in job.results() if r.role == "worker"}
    survivors = [results[0], results[1]]
    assert all(r.returncode == 3 for r in survivors), "\n".join(map(str, survivors))
    ranks = {int(m) for r in survivors for m in re.findall(r"^DIED rank=(\d+)", r.output, re.M)}
    assert len(ranks) == 1 and ranks != {-1}, "\n".join(map(str, survivors))  # both name the same worker


def test_without_shared_memory_the_store_keeps_big_keys_in_private_memory(monkeypatch):
    # memfd_create may be refused (a sandbox): the store's buffers fall back instead of failing init
    import types

    import numpy as np

    from kvcore.collectives import Collectives
    from kvcore.stores import allreduce as allreduce_store
    from psnode.collectives.local import SharedRegions

    def refused(*args):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refused)
    collectives = Collectives.__new__(Collectives)  # the real calls down to the refused system call
    collectives._engine = types.SimpleNamespace(shared=SharedRegions([], "job"))
    with pytest.raises(OSError):
        collectives.shared_empty(8)
    store = allreduce_store.AllreduceKVStore.__new__(allreduce_store.AllreduceKVStore)
    store._coll = collectives
    buffer = store._buffer((1 << 20,), np.float32)
    assert buffer.shape == (1 << 20,) and buffer.dtype == np.float32
