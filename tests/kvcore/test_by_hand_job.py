"""A job started by hand, as MXNet's ``tools/launch.py``, dmlc-tracker or a shell script start one:
every process gets only ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
``DMLC_NUM_SERVER`` and ``DMLC_NUM_WORKER`` (plus the job key in the keyed cases), and runs the
user's script for every role: ``import kvcore`` runs the scheduler or the server (MXNet's rule).

No ``PSLAUNCH_JOB_ID`` is set, so every process must derive the same job id from the scheduler's
address (docs/env.md); the kit that starts jobs for the other tests always writes one, which is how
a per-process random id once broke these jobs without a test noticing.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import free_port, reap

REPO = Path(__file__).resolve().parents[2]
SUMS = str(REPO / "tests" / "kvcore" / "dist_scripts" / "sums.py")
PLACEMENT_CALLS = str(REPO / "tests" / "kvcore" / "dist_scripts" / "placement_calls.py")
NO_KEY_WARNING = "no job key (PSLAUNCH_JOB_KEY): this job is unauthenticated"
# MXNet's launch.py order for the local launcher starts servers and workers and the scheduler last;
# a scheduler started first is the other order a hand-written script may use.
SCHEDULER_LAST = ["server"] * 2 + ["worker"] * 3 + ["scheduler"]
SCHEDULER_FIRST = ["scheduler"] + ["server"] * 2 + ["worker"] * 3


def by_hand_env(role: str, root: str, port: int, servers: int, workers: int, **extra: str) -> dict[str, str]:
    """This machine's environment less every variable of the contract, plus the five of MXNet's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    env.update(DMLC_ROLE=role, DMLC_PS_ROOT_URI=root, DMLC_PS_ROOT_PORT=str(port),
               DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers), PYTHONPATH=str(REPO), **extra)
    return env


class HandJob:
    """Processes started one by one in the given order, each in its own session; ``finish`` waits
    for all of them within a deadline and reaps whatever is left (the ``hand_job`` fixture reaps
    them too when a test fails before that)."""

    def __init__(self, tmp_path: Path, name: str = "job") -> None:
        self.tmp_path = tmp_path
        self.name = name
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, role: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.tmp_path / f"{self.name}.{role}.{len(self.procs)}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=REPO)
        self.procs.append((role, popen, log))

    def finish(self, timeout: float) -> list[tuple[str, int | None, str]]:
        """Each process's role, exit code (None: killed at the deadline) and output."""
        try:
            for _, popen, _ in self.procs:
                try:
                    popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    break
        finally:
            codes = [popen.poll() for _, popen, _ in self.procs]
            reap([popen for _, popen, _ in self.procs])
        return [(role, code, log.read_text(errors="replace")) for (role, _, log), code in zip(self.procs, codes)]


@pytest.fixture
def hand_job(tmp_path):
    """``hand_job(name)`` makes a ``HandJob`` logging under ``tmp_path``; every one is reaped at the end."""
    made: list[HandJob] = []

    def make(name: str = "job") -> HandJob:
        made.append(HandJob(tmp_path, name))
        return made[-1]

    yield make
    reap([popen for job in made for _, popen, _ in job.procs])


def assert_formed(results: list[tuple[str, int | None, str]], workers: int) -> None:
    report = "\n".join(f"--- {role} exited {code}:\n{out[-2000:]}" for role, code, out in results)
    assert all(code == 0 for _, code, _ in results), report
    ranks = sorted(int(m) for role, _, out in results if role == "worker" for m in re.findall(r"^OK (\d+)", out, re.M))
    assert ranks == list(range(workers)), report


@pytest.mark.parametrize("order", [SCHEDULER_LAST, SCHEDULER_FIRST], ids=["scheduler_last", "scheduler_first"])
def test_a_job_started_with_only_mxnets_five_variables_forms_and_sums_exactly(hand_job, order):
    port = free_port()
    job = hand_job()
    for role in order:
        job.start(role, [sys.executable, SUMS], by_hand_env(role, "127.0.0.1", port, servers=2, workers=3))
    results = job.finish(timeout=90)
    assert_formed(results, workers=3)
    # unauthenticated on loopback, and every process says so (docs/env.md, "The job key")
    for role, _, out in results:
        assert out.count(NO_KEY_WARNING) == 1, f"{role}:\n{out}"


@pytest.mark.parametrize("how", ["key_file", "key_variable"])
def test_a_keyed_job_started_by_hand_runs_authenticated_and_refuses_a_process_with_another_key(tmp_path, hand_job, how):
    key, wrong = secrets.token_hex(32), secrets.token_hex(32)

    def keyed(role: str, value: str, name: str) -> dict[str, str]:
        if how == "key_variable":
            return by_hand_env(role, "127.0.0.1", port, servers=2, workers=2, PSLAUNCH_JOB_KEY=value)
        path = tmp_path / f"{name}.key"
        path.write_text(value + "\n")
        path.chmod(0o600)
        return by_hand_env(role, "127.0.0.1", port, servers=2, workers=2, PSLAUNCH_JOB_KEY_FILE=str(path))

    port = free_port()
    job, outsider = hand_job(), hand_job("outsider")
    for role in ["scheduler", "server", "server", "worker"]:
        job.start(role, [sys.executable, SUMS], keyed(role, key, "job"))
    # a process that holds another key meets the scheduler while the job waits for its last worker
    outsider.start("worker", [sys.executable, SUMS], keyed("worker", wrong, "outsider"))
    [(_, code, out)] = outsider.finish(timeout=60)
    assert code not in (0, None), out
    assert re.search(rf"the scheduler at 127\.0\.0\.1:{port} refused this node's credentials", out), out
    assert key not in out and wrong not in out
    job.start("worker", [sys.executable, SUMS], keyed("worker", key, "job"))
    results = job.finish(timeout=90)
    assert_formed(results, workers=2)
    for role, _, out in results:
        assert NO_KEY_WARNING not in out, f"{role}:\n{out}"
        assert key not in out and wrong not in out
    scheduler_out = next(out for role, _, out in results if role == "scheduler")
    assert re.search(r"a node of job 'job-[0-9a-f]{8}' presented a wrong key", scheduler_out), scheduler_out


def test_two_jobs_started_by_hand_on_one_host_stay_apart(hand_job):
    # two schedulers on two ports: each job's processes derive their own job id and only join theirs
    jobs = []
    for name in ("a", "b"):
        port, job = free_port(), hand_job(name)
        for role in SCHEDULER_LAST[:1] + ["worker", "worker", "scheduler"]:
            job.start(role, [sys.executable, SUMS], by_hand_env(role, "127.0.0.1", port, servers=1, workers=2))
        jobs.append(job)
    for job in jobs:
        assert_formed(job.finish(timeout=90), workers=2)


@pytest.mark.netns
def test_a_keyed_job_started_by_hand_across_two_simulated_hosts_runs(tmp_path, hand_job):
    from testkit.netns import NetnsCluster, usable

    why = usable()
    if why is not None:
        pytest.fail(f"the simulated cluster cannot be made here: {why}")
    key = tmp_path / "job.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    with NetnsCluster(nics=("eth0", "eth0")) as cluster:
        root, port = cluster.address("h1"), free_port()
        job = hand_job()
        # servers and workers on both hosts, the scheduler last on h1: no loopback address anywhere
        for host, role in [("h1", "server"), ("h2", "server"), ("h1", "worker"), ("h2", "worker"),
                           ("h2", "worker"), ("h1", "scheduler")]:
            env = by_hand_env(role, root, port, servers=2, workers=3, PSLAUNCH_JOB_KEY_FILE=str(key))
            job.start(role, cluster.run_in(host, [sys.executable, SUMS]), env)
        results = job.finish(timeout=90)
    assert_formed(results, workers=3)
    for role, _, out in results:
        assert NO_KEY_WARNING not in out, f"{role}:\n{out}"


@pytest.mark.parametrize("mode", ["one-call-vs-per-call", "subset"])
def test_worker_0_inits_40_keys_in_one_call_and_worker_1_one_at_a_time_in_reverse_and_sums_are_exact(hand_job, mode):
    # worker 1's 40 init calls once met worker 0's single call at init barriers that never matched:
    # every process waited until it was killed. "subset": worker 1 inits only every other key.
    port = free_port()
    job = hand_job()
    for role in ["scheduler", "server", "server", "worker", "worker"]:
        job.start(role, [sys.executable, PLACEMENT_CALLS, mode, "ones:40"],
                  by_hand_env(role, "127.0.0.1", port, servers=2, workers=2))
    assert_formed(job.finish(timeout=90), workers=2)


def test_a_worker_that_names_the_scheduler_localhost_joins_the_others_that_name_it_127_0_0_1(hand_job):
    # each process derives the job id from DMLC_PS_ROOT_URI as it is written: once "localhost" made
    # another job's id, and the worker was refused ("port ... belongs to job ...")
    port = free_port()
    job = hand_job()
    for role, root in [("scheduler", "127.0.0.1"), ("server", "127.0.0.1"), ("worker", "localhost"),
                       ("worker", "127.0.0.1")]:
        job.start(role, [sys.executable, SUMS], by_hand_env(role, root, port, servers=1, workers=2))
    assert_formed(job.finish(timeout=90), workers=2)


@pytest.mark.parametrize("name, value, words", [
    ("DMLC_NUM_WORKER", "two", "environment variable DMLC_NUM_WORKER='two' is not an integer"),
    ("DMLC_PS_ROOT_PORT", "", "environment variable DMLC_PS_ROOT_PORT is not set; it is required"),
])
def test_a_malformed_contract_variable_ends_a_worker_with_one_line_naming_it(hand_job, name, value, words):
    # once a 38-line chained traceback with the sentence at its end
    job = hand_job()
    env = by_hand_env("worker", "127.0.0.1", free_port(), servers=1, workers=2)
    env[name] = value
    job.start("worker", [sys.executable, SUMS], env)
    [(_, code, out)] = job.finish(timeout=30)
    assert code == 1 and len(out.splitlines()) == 1, out
    assert out.startswith(f"kvcore: error: {words}") and "docs/env.md" in out, out
