"""The root cause is the process that failed on its own, on every backend, run after run.

A dist_sync job whose worker R raises at step k: the scheduler, the server and the other worker
end because of it (exit 75, one line naming worker R). pslaunch must name worker R, show its
traceback in its last lines, and exit with its code, every time, however the exits race.
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from testkit.launcher import BATCH_BACKENDS, Launch, backend_launch, helper, run_pslaunch, wait_gone

RUNS = 20  # each (rank, step) pair twice: the exits race differently run after run
RUNS_REMOTE = 10  # each pair once where a job costs seconds more (ssh, mpirun)
_TABLE_ROW = re.compile(r"^\| (scheduler|server|worker) +\| +(\d+) \| ([^|]+?) +\| +[-\d]+ \| ([^|]+?) +\| +[\d.]+s \| ([^|]*?) *\|$",
                        re.M)


def _rows(stderr: str) -> dict[str, tuple[str, str]]:
    """The summary table: ``{"worker.1": (exit, note)}``."""
    return {f"{m[1]}.{m[2]}": (m[4], m[5]) for m in _TABLE_ROW.finditer(stderr)}


def _run_failing_jobs(launch: Launch, marker: str, python: list[str], runs: int = RUNS) -> None:
    def one(i: int) -> tuple[int, int, object]:
        rank, step = i % 2, i % 5
        res = launch.run(["-n", "2", "-s", "1", *launch.args, "--timeout", "60", "--env", f"RAISE_RANK:{rank}",
                          "--env", f"RAISE_STEP:{step}", *python, helper("raise_at_step.py"), marker], timeout=90)
        return rank, step, res

    # Two jobs at a time: a failing job spends much of its life waiting on sockets and handshakes.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, range(runs)))
    for rank, step, res in results:
        culprit = f"worker.{rank}"
        failure = f"RuntimeError: worker {rank} fails at step {step}"
        context = f"run with worker {rank} failing at step {step}:\n{res.stdout}\n{res.stderr}"
        assert res.returncode == 1, context
        assert re.search(rf"^pslaunch: root cause: {culprit}@\S+ \(worker rank {rank} on \S+, pid \d+\) failed first: "
                         r"exit code 1$", res.stderr, re.M), context
        last = res.stderr.split(f"pslaunch: last lines of {culprit}@", 1)[1]
        assert "pslaunch:   | Traceback (most recent call last):" in last and f"pslaunch:   | {failure}" in last, context
        assert "mpirun" not in last and "Primary job" not in last, context
        rows = _rows(res.stderr)
        assert rows[culprit] == ("1", "root cause"), context
        for name, (code, note) in rows.items():
            if name != culprit:  # bystanders ended because of it, or were stopped; none "failed"
                assert note in ("ended: a peer failed", "stopped by pslaunch"), context
                assert code in ("75", "signal SIGTERM", "143 (128+SIGTERM)"), context  # ssh: the guard's code
        assert "Segmentation" not in res.stderr and "SIGSEGV" not in res.stderr, context
    assert wait_gone(marker, 10) == []


@pytest.mark.parametrize("backend", ["local", "ssh", "mpi"])
def test_a_worker_raising_at_step_k_is_the_root_cause_with_its_traceback_every_run(backend, request, tmp_path, marker):
    _run_failing_jobs(backend_launch(backend, request, tmp_path), marker, ["python"],
                      runs=RUNS if backend == "local" else RUNS_REMOTE)


@pytest.mark.parametrize("backend", BATCH_BACKENDS)
def test_a_worker_raising_at_step_k_is_the_root_cause_with_its_traceback_on_a_batch_scheduler(
        backend, request, tmp_path, marker):
    # Two runs (each worker failing once), not twenty: a job through the scheduler costs seconds more.
    _run_failing_jobs(backend_launch(backend, request, tmp_path), marker, ["python"], runs=2)


def test_the_failing_workers_traceback_is_the_first_thing_on_the_screen():
    res = run_pslaunch(["-n", "2", "-s", "1", "--launcher", "local", "--env", "RAISE_RANK:0", "--env", "RAISE_STEP:1",
                        sys.executable, helper("raise_at_step.py")], timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr.splitlines()[0] == "[worker.0@localhost] Traceback (most recent call last):", res.stderr


@pytest.mark.parametrize("code", [2, 3])
def test_a_child_exiting_with_one_of_pslaunchs_own_codes_makes_pslaunch_exit_1_and_shows_the_real_code(tmp_path, code):
    res = run_pslaunch(["-n", "1", "-s", "1", "--launcher", "local", "--env-worker", f"EXIT_worker_0:{code}",
                        "--command-for-all-roles", "--env-server", "SLEEP_scheduler:forever",
                        "--env-server", "SLEEP_server:forever", "--stop-grace", "2",
                        sys.executable, helper("role.py"), str(tmp_path)])
    assert res.returncode == 1, res.stderr
    assert (f"failed first: exit code {code}; pslaunch exits 1 because it keeps 2-5 for its own errors"
            in res.stderr), res.stderr
    assert _rows(res.stderr)["worker.0"] == (str(code), "root cause")
