"""The scheduler started again in place (``--restart-scope worker``): it holds no training state, so
when it dies pslaunch starts it alone, every server and worker registers again with its rank, sends
again what it had asked and not been answered (barriers, its finish) and what the scheduler keeps for
the job (ledger entries, rendezvous values), and the job goes on; pushes and pulls never stopped. The
final weights equal an uninterrupted run's (tests/launcher/helpers/replace_sync.py), and no other
process was started again.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time

import pytest

from launcher import launch
from testkit.launcher import helper, live_processes, reaped, run_pslaunch, wait_gone
from testkit.launcher.outcome import ended_like, same_weights, saved_weights, table_rows
from testkit.launcher.processes import start_pslaunch

HELPER = helper("replace_sync.py")
ENV = ["--env", "PSLAUNCH_BIGARRAY_BOUND:1000"]
STEPS = 150
# barriers every 4 steps: some of them wait on the scheduler when it dies
SETTINGS = ["--env", f"STEPS:{STEPS}", "--env", "STEP_SLEEP:0.02", "--env", "BARRIER_EVERY:4"]
REPLACE = ["--max-restarts", "3", "--restart-scope", "worker"]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    res = run_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, *SETTINGS, "--timeout", "100", "python", HELPER,
                        str(out)], timeout=120)
    assert res.returncode == 0, res.stderr
    return saved_weights(out)


def _scheduler(pslaunch_pid: int) -> int | None:
    return next((p.pid for p in live_processes()
                 if p.ppid == pslaunch_pid and b"psnode" in p.argv and b"scheduler" in p.argv), None)


def _running(out, proc, seconds):
    deadline = time.monotonic() + 40
    while not (out / "starts.txt").exists() or len((out / "starts.txt").read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
        time.sleep(0.05)
    time.sleep(seconds)


@pytest.mark.parametrize("replicas", [[], ["--server-replicas", "1"]], ids=["servers", "servers-with-replicas"])
def test_a_killed_scheduler_is_started_alone_and_the_job_goes_on_with_the_samesaved_weights(tmp_path, reference, replicas):
    proc = start_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, *SETTINGS, *REPLACE, *replicas, "--timeout",
                           "150", "python", HELPER, str(tmp_path)])
    with reaped(proc, str(tmp_path)):
        _running(tmp_path, proc, 1.0)
        before = {p.pid for p in live_processes() if p.ppid == proc.pid}
        killed = _scheduler(proc.pid)
        assert killed is not None
        subprocess.run(["kill", "-9", str(killed)], check=True)
        _, err = proc.communicate(timeout=160)
    stderr = err.decode()
    ended_like(proc.returncode, stderr, tmp_path, reference)
    rows = table_rows(stderr)
    schedulers = [r for r in rows if r[0] == "scheduler"]
    assert [(int(r[2]), r[3], r[4]) for r in schedulers][0] == (killed, "signal SIGKILL", "failed; restarted alone"), rows
    assert re.fullmatch(r"replacement; nodes back after [\d.]+s", schedulers[1][4]), rows
    # every other process is the one that ran before the kill, and ended well
    others = [r for r in rows if r[0] != "scheduler"]
    assert {int(r[2]) for r in others} <= before and all(r[3] == "0" for r in others), (rows, before)
    assert re.search(r"pslaunch: scheduler\.0@\S+ replaced in place at [\d.]+ s \(signal SIGKILL; pid \d+ -> \d+, "
                     r"restart 1\): the job's nodes were back with it [\d.]+ s after the end", stderr), stderr
    assert "scheduler: took the job back: " in stderr


def test_the_scheduler_killed_at_random_moments_twice_leaves_the_weights_as_they_were(tmp_path, reference):
    # wherever the kills land: registration, a barrier, mid-round, the workers' finish
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    proc = start_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, *SETTINGS, *REPLACE, "--timeout", "150",
                           "python", HELPER, str(tmp_path)])
    killed = []
    with reaped(proc, str(tmp_path)):
        for _ in range(2):
            time.sleep(rng.uniform(0.3, 2.5))
            pid = _scheduler(proc.pid)
            if pid is not None and proc.poll() is None:
                subprocess.run(["kill", "-9", str(pid)], check=False)
                killed.append(pid)
        _, err = proc.communicate(timeout=160)
    stderr = err.decode()
    assert not wait_gone(str(tmp_path))
    assert proc.returncode == 0, f"seed {seed}, killed {killed}:\n{stderr}"
    assert same_weights(saved_weights(tmp_path), reference), f"seed {seed}: the weights differ"
    assert stderr.count("scheduler.0@localhost replaced in place") == len(killed), stderr


def test_the_scheduler_replaced_is_in_the_run_result(tmp_path):
    # through the Python API: the replacement names the scheduler, and no worker was started again
    import threading

    def kill_later():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (tmp_path / "starts.txt").exists() and len((tmp_path / "starts.txt").read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        time.sleep(0.8)
        for proc in live_processes():
            if b"psnode" in proc.argv and b"scheduler" in proc.argv and \
                    proc.environ().get(b"PSLAUNCH_TEST_TAG") == str(tmp_path).encode():
                subprocess.run(["kill", "-9", str(proc.pid)], check=False)
                return

    killer = threading.Thread(target=kill_later, daemon=True)
    killer.start()
    result = launch([sys.executable, HELPER, str(tmp_path)], num_workers=2, num_servers=2, max_restarts=2,
                    restart_scope="worker", timeout=90,
                    env={"PSLAUNCH_BIGARRAY_BOUND": "1000", "STEPS": str(STEPS), "STEP_SLEEP": "0.02",
                         "BARRIER_EVERY": "4", "PSLAUNCH_TEST_TAG": str(tmp_path)})
    killer.join(5)
    assert result.ok, result.root_cause
    (record,) = result.replacements
    assert (record.process, record.rank, record.ended) == ("scheduler.0@localhost", 0, "signal SIGKILL"), record
    assert record.waited_s is not None and record.waited_s > 0, record
    assert sorted(open(tmp_path / "starts.txt").read().split("\n")[:-1]) == ["0 0 0", "1 0 0"]  # no worker restarted
    assert not wait_gone(str(tmp_path))


def test_without_restart_scope_worker_a_killed_scheduler_still_ends_the_job(tmp_path):
    proc = start_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, *SETTINGS, "--timeout", "100", "python",
                           HELPER, str(tmp_path)])
    with reaped(proc, str(tmp_path)):
        _running(tmp_path, proc, 0.5)
        subprocess.run(["kill", "-9", str(_scheduler(proc.pid))], check=True)
        _, err = proc.communicate(timeout=100)
    stderr = err.decode()
    assert proc.returncode == 137, stderr
    assert re.search(r"root cause: scheduler\.0@\S+ \(scheduler rank 0 .*\) failed first: signal SIGKILL", stderr), stderr
    assert not wait_gone(str(tmp_path))
