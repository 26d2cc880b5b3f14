"""A hang is named (``--stall-warn S``, ``PSLAUNCH_STALL_WARN``): a ``dist_sync`` round that has waited
S seconds for a worker's push, or a barrier that waited S seconds for a rank, is said in the log,
once, naming the key or barrier, the round, the ranks it waits for with their hosts and who came;
without a terminal too (plain output, as here). A long step under the threshold is no stall."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from testkit.launcher import REPO, helper, run_pslaunch, wait_gone
from testkit.launcher.terminal import run_in_terminal

HELPER = helper("replace_sync.py")
ENV = ["--env", "PSLAUNCH_BIGARRAY_BOUND:1000"]

pytestmark = pytest.mark.timeout(120)


def _job(out, *args, env=()):
    env_args = [a for item in env for a in ("--env", item)]
    timeout = [] if "--timeout" in args else ["--timeout", "60"]
    res = run_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, "--env", "STEPS:6", *env_args, *args, *timeout,
                        "python", HELPER, str(out)], timeout=90)
    assert not wait_gone(str(out))
    return res


def test_a_round_that_waits_for_a_workers_push_is_said_stalled_naming_the_key_the_round_and_the_worker(tmp_path):
    # worker 1 sleeps 3 s before its pushes of step 3: the servers' rounds 4 wait for it
    res = _job(tmp_path, "--stall-warn", "1", env=["STALL:1:3:compute:3"])
    assert res.returncode == 0, res.stderr
    lines = re.findall(r"server \d: stalled: round 4 of key \d+ and \d+ more has waited \d+ s \(PSLAUNCH_STALL_WARN=1\) "
                       r"for worker 1 on 127\.0\.0\.1; worker 0 pushed", res.stderr)
    assert len(lines) == 2, res.stderr  # once per server
    assert "stalled: barrier" not in res.stderr


def test_a_barrier_that_waits_for_a_rank_is_said_stalled_naming_who_came(tmp_path):
    # a barrier every 2 steps (after the set-up barriers); worker 1 sleeps 3 s after step 3 was marked, before the
    # barrier of step 4
    res = _job(tmp_path, "--stall-warn", "1", env=["BARRIER_EVERY:2", "STALL:1:3:marked:3"])
    assert res.returncode == 0, res.stderr
    assert re.search(r"scheduler: stalled: barrier \d+ of the workers has waited \d s \(PSLAUNCH_STALL_WARN=1\) for "
                     r"worker 1 on 127\.0\.0\.1; 1 of 2 arrived \(worker 0\)", res.stderr), res.stderr
    assert res.stderr.count("stalled: barrier") == 1


@pytest.mark.parametrize("warn", ["5", "0"], ids=["under-the-threshold", "off"])
def test_a_long_step_under_the_threshold_or_with_the_warning_off_is_no_stall(tmp_path, warn):
    res = _job(tmp_path, "--stall-warn", warn, env=["STALL:1:3:compute:2"])
    assert res.returncode == 0, res.stderr
    assert "stalled" not in res.stderr, res.stderr


def test_a_negative_threshold_is_refused_before_anything_starts(tmp_path):
    res = run_pslaunch(["-n", "2", "--stall-warn", "-1", "--dry-run", "python", HELPER, str(tmp_path)], timeout=30)
    assert res.returncode == 2 and "--stall-warn must be >= 0 seconds (0: never), got -1" in res.stderr, res.stderr


def test_a_timeout_names_what_the_job_was_waiting_on_and_the_summary_lists_the_stalls(tmp_path):
    # worker 1 sleeps 100 s before its pushes of step 2: without a terminal, the --timeout verdict says why
    summary = tmp_path / "summary.json"
    res = _job(tmp_path, "--stall-warn", "1", "--summary-json", str(summary), "--timeout", "6",
               env=["STALL:1:2:compute:100"])
    assert res.returncode == 124, res.stderr
    assert re.search(r"root cause: the job ran longer than --timeout 6 s; the job was waiting: server \d: stalled: "
                     r"round 3 of key \d+ and \d+ more has waited \d+ s \(PSLAUNCH_STALL_WARN=1\) for worker 1 on "
                     r"127\.0\.0\.1; worker 0 pushed", res.stderr), res.stderr
    stalls = json.loads(summary.read_text())["stalls"]
    assert len(stalls) == 2 and {s["process"] for s in stalls} == {"server.0@localhost", "server.1@localhost"}, stalls
    assert all("for worker 1 on 127.0.0.1" in s["text"] and s["at_s"] > 1 for s in stalls), stalls


def test_the_worker_a_stalled_round_waits_for_shows_where_its_code_is(tmp_path):
    # worker 1 sleeps in maybe_die before its pushes: pslaunch asks it for its stack, which names that function
    res = _job(tmp_path, "--stall-warn", "1", env=["STALL:1:2:compute:4"])
    assert res.returncode == 0, res.stderr
    assert re.search(r"pslaunch: worker\.1@localhost \(worker rank 1 .*\) is what stalled rounds or barriers wait for; "
                     r"its Python stack follows in its output", res.stderr), res.stderr
    assert re.search(r"\[worker\.1@localhost\] +File \".*replace_sync\.py\", line \d+ in maybe_die", res.stderr), res.stderr
    assert res.stderr.count("is what stalled rounds or barriers wait for") == 1  # two servers said it: asked once


def test_the_live_table_in_a_terminal_says_what_is_stalled(tmp_path, marker):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: run scripts/test.sh (it installs tmux)")
    socket_name = f"pslaunch-{marker}"
    out = tmp_path / marker
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(
        f"cd {REPO}\nexport PYTHONPATH={REPO}\n"
        f"{sys.executable} -m launcher.cli -n 2 -s 2 {' '.join(ENV)} --stall-warn 1 --env STEPS:6 "
        f"--env STALL:1:3:compute:6 --timeout 60 {sys.executable} {HELPER} {out}\necho EXIT=$?\n")
    seen, screen = run_in_terminal(script, socket_name, r"STALLED at 0:0\d: round 4 of key \d+", width=220, timeout=40)
    assert seen, f"the live table never said what is stalled:\n{screen}"
    assert "EXIT=0" in screen, screen
    assert not wait_gone(str(out))
