"""An elastic job (``-n MIN:MAX``, ``PSLAUNCH_MIN_WORKERS``): MAX workers start under ``--launcher local``;
a worker that gets SIGTERM (a preempted pod, a spot notice) finishes its step (its push is announced as
its last), leaves at the next step boundary and exits 0, while every other process goes on; each
``dist_sync`` round sums exactly the workers that were members in it, and ``kv.num_workers`` at each
step is that step's members. Below MIN the job waits ``--elastic-timeout`` and fails naming why.
What cannot be elastic (mpi, the batch schedulers, -s 0) is refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from testkit import free_port, reap
from testkit.launcher import REPO, helper, reaped, run_pslaunch, start_pslaunch, wait_gone
from testkit.launcher.processes import job_worker

pytestmark = pytest.mark.timeout(120)

HELPER = helper("elastic_sum.py")


def _records(out) -> dict[int, list[tuple[int, int, float]]]:
    """Each worker's ``(step, num_workers, value)`` lines."""
    got: dict[int, list[tuple[int, int, float]]] = {}
    for path in out.glob("steps.*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                got.setdefault(int(parts[0]), []).append((int(parts[1]), int(parts[2]), float(parts[3])))
    return got


def _closed_form(steps: int, members: dict[int, set[int]]) -> list[float]:
    """The value after each step: the sum over that step's members of (rank + 1) * (step + 1)."""
    return [float(sum(r + 1 for r in members[s]) * (s + 1)) for s in range(steps)]


def test_workers_that_get_sigterm_leave_at_a_step_boundary_and_every_round_sums_its_members(tmp_path):
    # 4 start (-n 2:4); worker 3 gets SIGTERM after step 2's pulls, worker 2 after step 4's: each makes
    # the push of the step under way (3, 5) its last; W goes 4 -> 3 -> 2
    summary = tmp_path / "summary.json"
    res = run_pslaunch(["-n", "2:4", "-s", "2", "--no-dashboard", "--env", "STEPS:8", "--env", "STEP_SLEEP:0.15",
                        "--env", "LEAVE:3:2,2:4",
                        "--summary-json", str(summary), "--timeout", "60", "python", HELPER, str(tmp_path)], timeout=90)
    assert res.returncode == 0, res.stderr
    members = {s: {0, 1, 2, 3} if s <= 3 else {0, 1, 2} if s <= 5 else {0, 1} for s in range(8)}
    got = _records(tmp_path)
    for rank in (0, 1):
        assert [v for _, _, v in got[rank]] == _closed_form(8, members), got[rank]
        assert [n for _, n, _ in got[rank]] == [len(members[s]) for s in range(8)], got[rank]  # kv.num_workers
    assert [s for s, _, _ in got[3]] == [0, 1, 2, 3] and [s for s, _, _ in got[2]] == [0, 1, 2, 3, 4, 5], got
    for rank in (2, 3):
        assert f"[worker.{rank}@localhost] worker {rank} left the job at a step boundary (SIGTERM)" in res.stderr
    assert re.search(r"scheduler: worker 2 on \S+ left the job at a step boundary; 2 workers go on \(minimum 2\)",
                     res.stderr), res.stderr
    rows = {p["name"]: p for p in json.loads(summary.read_text())["processes"]}
    assert all(rows[f"worker.{r}@localhost"]["exit_code"] == 0 for r in range(4)), rows
    assert rows["worker.3@localhost"]["note"].startswith("left the job at "), rows
    assert rows["worker.3@localhost"]["duration_s"] < rows["worker.0@localhost"]["duration_s"], rows
    assert not wait_gone(str(tmp_path))


def test_a_worker_killed_with_sigterm_from_outside_at_any_moment_leaves_exactly(tmp_path):
    # 3 start (-n 2:3); the test sends worker 2 SIGTERM mid-job, wherever its loop is
    out = tmp_path / "out"
    out.mkdir()
    args = ["-n", "2:3", "-s", "1", "--no-dashboard", "--env", "STEPS:40", "--env", "STEP_SLEEP:0.05", "--timeout", "60",
            "python", HELPER, str(out)]
    with reaped(start_pslaunch(args), str(out)) as proc:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len((_records(out).get(2) or [])) < 5:
            time.sleep(0.05)
        pid = job_worker(str(out), 2)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    got = _records(out)
    last = got[2][-1][0]  # its last step: it left at the push of the next
    members = {s: {0, 1, 2} if s <= last else {0, 1} for s in range(40)}
    assert [v for _, _, v in got[0]] == _closed_form(40, members), (last, got[0])
    assert 4 <= last < 39


def test_below_the_minimum_the_job_waits_the_elastic_timeout_and_fails_naming_why(tmp_path):
    # -n 2:3: workers 2 and 1 leave, one is left; nothing can join under --launcher local
    res = run_pslaunch(["-n", "2:3", "-s", "1", "--no-dashboard", "--env", "STEPS:200", "--env", "STEP_SLEEP:0.02",
                        "--env", "LEAVE:2:1,1:2", "--elastic-timeout", "2", "--timeout", "60", "python", HELPER,
                        str(tmp_path)], timeout=90)
    assert res.returncode != 0, res.stderr
    assert re.search(r"root cause: scheduler\.0@localhost .*\n(.*\n)*.*the job has 1 worker, fewer than its minimum of 2 "
                     r"\(PSLAUNCH_MIN_WORKERS\), and no worker came within \d s \(PSLAUNCH_ELASTIC_TIMEOUT=2\); left: "
                     r"worker 2 on \S+, worker 1 on \S+", res.stderr), res.stderr
    assert not wait_gone(str(tmp_path))


def test_a_script_may_end_on_its_own_terms_once_kv_leaving_says_so(tmp_path):
    res = run_pslaunch(["-n", "1:2", "-s", "1", "--no-dashboard", "--env", "STEPS:8", "--env", "LEAVE:1:3", "--env",
                        "OWN_TERMS:1", "--timeout", "60", "python", HELPER, str(tmp_path)], timeout=90)
    assert res.returncode == 0, res.stderr
    got = _records(tmp_path)  # SIGTERM after step 3's pulls: step 4 is its last, then kv.leaving ends the loop
    assert [s for s, _, _ in got[1]] == [0, 1, 2, 3, 4] and "1 done" in (tmp_path / "steps.1.txt").read_text()
    assert [v for _, _, v in got[0]] == _closed_form(8, {s: {0, 1} if s <= 4 else {0} for s in range(8)}), got[0]
    assert "worker 1 left the job at a step boundary (SIGTERM); 1 worker goes on" in res.stderr


def test_a_barrier_the_leaver_was_the_last_one_missing_from_completes_when_it_leaves(tmp_path):
    # worker 1 ends its loop on its own terms after step 3 (SIGTERM after step 2's pulls: step 3 is its
    # last) and leaves 2 s later, from kv.close(); worker 0 waits for it in the barrier that starts step 4
    res = run_pslaunch(["-n", "1:2", "-s", "1", "--no-dashboard", "--env", "STEPS:6", "--env", "LEAVE:1:2", "--env",
                        "OWN_TERMS:1", "--env", "BARRIER:1", "--env", "CLOSE_SLEEP:2", "--timeout", "60", "python",
                        HELPER, str(tmp_path)], timeout=90)
    assert res.returncode == 0, res.stderr
    got = _records(tmp_path)
    assert [v for _, _, v in got[0]] == _closed_form(6, {s: {0, 1} if s <= 3 else {0} for s in range(6)}), got[0]
    assert "1 done" in (tmp_path / "steps.1.txt").read_text()
    assert re.search(r"scheduler: worker 1 on \S+ left the job at a step boundary; 1 worker goes on", res.stderr)


def test_the_others_take_a_leave_at_their_step_boundary_kv_num_workers_and_the_reset_callbacks(tmp_path):
    # worker 2 gets SIGTERM after step 1's pulls: step 2 is its last, it leaves at its push of step 3; each
    # other worker's kv.num_workers drops at its step 3, exactly, and its State's reset callback runs once
    res = run_pslaunch(["-n", "2:3", "-s", "1", "--no-dashboard", "--env", "STEPS:8", "--env", "STEP_SLEEP:0.1",
                        "--env", "LEAVE:2:1", "--env", "RESETS:1", "--timeout", "60", "python", HELPER, str(tmp_path)],
                       timeout=90)
    assert res.returncode == 0, res.stderr
    got = _records(tmp_path)
    for rank in (0, 1):
        resets = (tmp_path / f"resets.{rank}.txt").read_text().split()
        assert len(resets) == 4 and resets[:2] == [str(rank), "reset"] and resets[3] == "2", resets
        at = int(resets[2])  # the step whose first push was the boundary it took the change at
        counts = [n for _, n, _ in got[rank]]
        assert counts == [3] * 3 + [2] * 5 and at == 3, (at, counts)
    assert not (tmp_path / "resets.2.txt").exists()


@pytest.mark.parametrize("args, message", [
    (["-n", "3:2"], "-n/--num-workers '3:2' has its minimum 3 above its maximum 2"),
    (["-n", "0:2"], "-n/--num-workers '0:2' must be >= 1, got 0"),
    (["-n", "2:x"], "-n/--num-workers '2:x' is not a number of workers: give N or MIN:MAX"),
    (["-n", "2:4", "-s", "0"], "-n 2:4 makes the job elastic, but -s 0 has no servers"),
    (["-n", "2:4", "--launcher", "mpi"], "-n 2:4 makes the job elastic, but --launcher mpi starts every rank at once"),
    (["-n", "2:4", "--launcher", "ray"], "-n 2:4 makes the job elastic, which runs with --launcher local, ssh and"),
    (["-n", "2:4", "--server-replicas", "1"], "-n 2:4 makes the job elastic, which does not go with --server-replicas"),
])
def test_what_cannot_be_elastic_is_refused_before_anything_starts(tmp_path, args, message):
    res = run_pslaunch([*args, "--dry-run", "python", HELPER, str(tmp_path)], timeout=30)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_the_plan_and_the_python_api_take_min_max(tmp_path):
    from launcher import launch

    result = launch(["python", HELPER, str(tmp_path)], num_workers="1:2", num_servers=1, dry_run=True)
    assert result.plan.count("PSLAUNCH_MIN_WORKERS=1") == 4 and "DMLC_NUM_WORKER=2" in result.plan, result.plan
    result = launch(["python", HELPER, str(tmp_path)], num_workers="1:2", num_servers=1, timeout=60,
                    env=["STEPS:6", "LEAVE:1:2"], dashboard=False)
    assert result.ok, result.root_cause
    assert _records(tmp_path)[0][-1][2] == 6.0  # worker 0 alone at step 5: 1 * 6


def test_a_job_started_by_hand_with_the_variables_lets_a_worker_leave(tmp_path):
    port, procs = free_port(), []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    base.update(PYTHONPATH=str(REPO), DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_SERVER="1",
                DMLC_NUM_WORKER="3", PSLAUNCH_MIN_WORKERS="2", STEPS="6", LEAVE="2:1")
    try:
        for index, role in enumerate(["scheduler", "server", "worker", "worker", "worker"]):
            with open(tmp_path / f"{index}.{role}.log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, HELPER, str(tmp_path)], env={**base, "DMLC_ROLE": role},
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        reap(procs)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert codes == [0] * 5, logs
    members = {s: {0, 1, 2} if s <= 2 else {0, 1} for s in range(6)}
    assert [v for _, _, v in _records(tmp_path)[0]] == _closed_form(6, members)
    assert "worker 2 left the job at a step boundary (SIGTERM); 2 workers go on" in logs


def test_ctrl_c_ends_an_elastic_job_at_once_a_torn_down_worker_does_not_wait_for_a_step_boundary(tmp_path):
    # the first SIGTERM is a notice to leave; pslaunch's teardown sends a second, which ends the worker
    out = tmp_path / "out"
    out.mkdir()
    summary = tmp_path / "summary.json"
    args = ["-n", "2:3", "-s", "1", "--no-dashboard", "--stop-grace", "30", "--summary-json", str(summary), "--env",
            "STEPS:4000", "--env", "STEP_SLEEP:0.05", "--timeout", "90", "python", HELPER, str(out)]
    with reaped(start_pslaunch(args), str(out)) as proc:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(_records(out).get(0) or []) < 3:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    rows = {p["name"]: p for p in json.loads(summary.read_text())["processes"]}
    # SIGTERM ended them (or one left at a boundary it reached at once): a worker waiting for a boundary
    # would have met SIGKILL after --stop-grace 30
    ended = [(rows[f"worker.{r}@localhost"]["signal"], rows[f"worker.{r}@localhost"]["exit_code"]) for r in range(3)]
    assert all(how in ((signal.SIGTERM, None), (None, 0), (None, 75)) for how in ended), rows
    assert not wait_gone(str(out))


def test_over_ssh_a_worker_on_another_host_leaves_and_the_rounds_sum_the_rest(sshd, tmp_path):
    # workers 0 and 2 on 127.0.0.2, 1 on 127.0.0.3; worker 2 gets SIGTERM after step 1: step 2 is its last
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    res = run_pslaunch(["-n", "2:3", "-s", "1", "-H", hosts, *sshd.ssh_flags(), "--no-dashboard", "--env",
                        f"PYTHONPATH:{REPO}", "--env", "STEPS:6", "--env", "LEAVE:2:1", "--timeout", "60", "python",
                        HELPER, str(tmp_path)], timeout=90)
    assert res.returncode == 0, res.stderr
    members = {s: {0, 1, 2} if s <= 2 else {0, 1} for s in range(6)}
    got = _records(tmp_path)
    assert [v for _, _, v in got[0]] == _closed_form(6, members) == [v for _, _, v in got[1]], got
    assert "[worker.2@127.0.0.2] worker 2 left the job at a step boundary (SIGTERM); 2 workers go on" in res.stderr
    assert not wait_gone(str(tmp_path))


def test_a_worker_killed_outright_is_dropped_and_the_job_goes_on_with_the_rest(tmp_path):
    # -n 2:3: worker 2 is SIGKILLed mid-job (a drained node, the OOM killer): no leave, no failure of the
    # job; the rounds after the last push the servers took from it sum workers 0 and 1
    out = tmp_path / "out"
    out.mkdir()
    summary = tmp_path / "summary.json"
    args = ["-n", "2:3", "-s", "1", "--no-dashboard", "--summary-json", str(summary), "--env", "STEPS:40", "--env",
            "STEP_SLEEP:0.05", "--timeout", "60", "python", HELPER, str(out)]
    with reaped(start_pslaunch(args), str(out)) as proc:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len((_records(out).get(2) or [])) < 5:
            time.sleep(0.05)
        pid = job_worker(str(out), 2)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 0, err
    got = _records(out)
    last = got[2][-1][0]  # its last logged step; it may have pushed the next before it died
    values = [v for _, _, v in got[0]]
    assert values == [v for _, _, v in got[1]] and len(values) == 40
    for step, value in enumerate(values):
        with_it, without = 6.0 * (step + 1), 3.0 * (step + 1)
        assert value == (with_it if step <= last else without if step > last + 1 else value), (step, value, last)
        assert value in (with_it, without)
    assert "worker.2@localhost" in err and "was lost: signal SIGKILL; the elastic job drops it" in err, err
    assert re.search(r"scheduler: worker 2 on \S+ was lost \(its connection closed", err), err
    rows = {p["name"]: p for p in json.loads(summary.read_text())["processes"]}
    assert rows["worker.2@localhost"]["note"] == "lost; dropped from the elastic job", rows


def test_the_survivors_of_a_lost_worker_agree_on_each_steps_members_wherever_they_heard_of_it(tmp_path):
    # -n 2:3: worker 2 is SIGKILLed after its step 4's pulls, once worker 1 took its step 5 batch (3 members)
    # and pushed; worker 0 hears of the loss before its step 5 boundary. Both survivors count the same
    # members at every step (the first without worker 2 is one the servers name: no survivor had reached
    # it), so they split each epoch alike (SplitSampler.elastic_batches), run the same steps and the job ends
    out = tmp_path / "out"
    out.mkdir()
    res = run_pslaunch(["-n", "2:3", "-s", "2", "--no-dashboard", "--env", "LOST_AT:4", "--timeout", "60",
                        "python", helper("elastic_lost.py"), str(out)], timeout=90)
    assert res.returncode == 0, res.stderr
    rows: dict[int, list[tuple[int, int, int, float]]] = {}
    for rank in (0, 1):
        lines = (out / f"lost.{rank}.txt").read_text().splitlines()
        assert lines[-1] == f"{rank} done", lines
        rows[rank] = [(int(e), int(s), int(m), float(v)) for _, e, s, m, v in (ln.split() for ln in lines[:-1])]
    assert rows[0] == rows[1], rows  # epoch, step, kv.num_workers and the round's value, step by step
    members = [m for _, _, m, _ in rows[0]]
    assert members[:6] == [3] * 6, members  # worker 1 took step 5 with worker 2 still counted
    first = members.index(2)
    assert first <= 7 and members[first:] == [2] * (len(members) - first), members  # at most 2 steps late, for good
    # each round sums the workers that pushed to it: worker 2's last push was its step 4
    assert [v for _, _, _, v in rows[0]] == [6.0] * 5 + [3.0] * (len(members) - 5), rows[0]
    assert (out / "lost.2.txt").read_text().splitlines()[-1].split()[2] == "4"
    assert "worker.2@localhost" in res.stderr and "was lost: signal SIGKILL; the elastic job drops it" in res.stderr
    assert not wait_gone(str(out))
