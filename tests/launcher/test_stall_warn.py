"""A hang is named (``--stall-warn S``, ``PSLAUNCH_STALL_WARN``): a ``dist_sync`` round that has waited
S seconds for a worker's push, a barrier that waited S seconds for a rank, or a collective one rank
skipped, is said in the log, once, naming the key or barrier, the round, the ranks it waits for with
their hosts and who came; without a terminal too (plain output, as here), and at the workers that
wait. A long step under the threshold is no stall. ``--stall-timeout S`` (``PSLAUNCH_STALL_TIMEOUT``)
ends the job with the stall as its root cause, the missing worker's stack quoted, exit code 86."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time

import pytest

from testkit.launcher import REPO, helper, run_pslaunch, wait_gone
from testkit.launcher.terminal import run_in_terminal

HELPER = helper("replace_sync.py")
SKIPPER = helper("skip_collective.py")
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
    lines = re.findall(r"\[server\.\d@localhost\] server \d: stalled: round 4 of key \d+ and \d+ more has waited \d+ s \(PSLAUNCH_STALL_WARN=1\) "
                       r"for worker 1 on 127\.0\.0\.1; worker 0 pushed", res.stderr)
    assert len(lines) == 2, res.stderr  # once per server
    assert "stalled: barrier" not in res.stderr
    # the worker that pushed and waits says it too (a job started by hand shows it in its log)
    assert re.search(r"\[worker\.0@localhost\] worker 0 waits on server \d: stalled: round 4 of key", res.stderr), res.stderr
    assert "worker 1 waits on" not in res.stderr


def test_a_barrier_that_waits_for_a_rank_is_said_stalled_naming_who_came(tmp_path):
    # a barrier every 2 steps (after the set-up barriers); worker 1 sleeps 3 s after step 3 was marked, before the
    # barrier of step 4
    res = _job(tmp_path, "--stall-warn", "1", env=["BARRIER_EVERY:2", "STALL:1:3:marked:3"])
    assert res.returncode == 0, res.stderr
    assert re.search(r"scheduler: stalled: barrier \d+ of the workers has waited \d s \(PSLAUNCH_STALL_WARN=1\) for "
                     r"worker 1 on 127\.0\.0\.1; 1 of 2 arrived \(worker 0\)", res.stderr), res.stderr
    assert res.stderr.count("[scheduler.0@localhost] scheduler: stalled: barrier") == 1
    assert re.search(r"\[worker\.0@localhost\] worker 0 waits on the scheduler: stalled: barrier \d+ of the workers",
                     res.stderr), res.stderr


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
    assert re.search(r"pslaunch: worker\.1@localhost \(worker rank 1 .*\) is what the stalled rounds, barriers or "
                     r"collectives wait for; its stack follows in its output", res.stderr), res.stderr
    assert re.search(r"\[worker\.1@localhost\] +File \".*replace_sync\.py\", line \d+ in maybe_die", res.stderr), res.stderr
    assert res.stderr.count("is what the stalled rounds") == 1  # two servers said it: asked once


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


STACK_LINE = r'File ".*replace_sync\.py", line \d+ in maybe_die'


def test_a_round_stalled_past_the_stall_timeout_ends_the_job_naming_the_rank_and_its_stack(tmp_path):
    # worker 1 sleeps 100 s before its pushes of step 2: 3 s into the stall the job ends, exit code 86
    summary = tmp_path / "summary.json"
    res = _job(tmp_path, "--stall-warn", "1", "--stall-timeout", "3", "--summary-json", str(summary),
               env=["STALL:1:2:compute:100"])
    assert res.returncode == 86, res.stderr
    assert re.search(r"root cause: server \d: stalled: round 3 of key \d+ and \d+ more has waited 3 s "
                     r"\(PSLAUNCH_STALL_TIMEOUT=3\) for worker 1 on 127\.0\.0\.1; worker 0 pushed; the job ends "
                     r"\(--stall-timeout\); worker\.1@localhost \(worker rank 1 .*\) is in maybe_die "
                     r"\(replace_sync\.py:\d+\)\n", res.stderr), res.stderr
    quoted = res.stderr.split("Python stack of worker.1@localhost's main thread (innermost call first):\n")[1]
    assert re.match(r"pslaunch:   \| (Current thread|Thread) 0x[0-9a-f]+ .*\npslaunch:   \| " + STACK_LINE, quoted), quoted
    assert "exit code 86" in res.stderr
    root = json.loads(summary.read_text())["root_cause"]
    assert root["process"] == "worker.1@localhost" and re.search(STACK_LINE, root["last_lines"][1]), root


def test_a_barrier_stalled_past_the_stall_timeout_ends_the_job_from_python(tmp_path):
    from launcher import launch

    # worker 1 sleeps 100 s after step 3 was marked, before the barrier of step 4; --stall-warn stays at 60
    result = launch(["python", HELPER, str(tmp_path)], num_workers=2, num_servers=2, stall_timeout=2, timeout=60,
                    dashboard=False, env=["PSLAUNCH_BIGARRAY_BOUND:1000", "STEPS:6", "BARRIER_EVERY:2",
                                          "STALL:1:3:marked:100"])
    assert not wait_gone(str(tmp_path))
    assert result.exit_code == 86 and result.root_cause.process == "worker.1@localhost", result.root_cause
    assert re.match(r"scheduler: stalled: barrier \d+ of the workers has waited 2 s \(PSLAUNCH_STALL_TIMEOUT=2\) for "
                    r"worker 1 on 127\.0\.0\.1; 1 of 2 arrived \(worker 0\); the job ends \(--stall-timeout\); "
                    r"worker\.1@localhost .* is in maybe_die", result.root_cause.reason), result.root_cause.reason
    assert any(re.search(STACK_LINE, line) for line in result.root_cause.last_lines), result.root_cause.last_lines


def test_waits_shorter_than_the_stall_timeout_each_are_no_stall_however_many(tmp_path):
    # three steps each 2 s late: 6 s of waiting in all, but no one wait reaches the 3.5 s threshold
    res = _job(tmp_path, "--stall-timeout", "3.5", env=["STALL:1:1:compute:2,1:2:compute:2,1:3:compute:2"])
    assert res.returncode == 0, res.stderr
    assert "stalled" not in res.stderr


def test_a_collective_one_rank_skips_is_said_stalled_at_the_worker_that_waits_and_the_timeout_ends_it(tmp_path):
    # worker 1 skips allreduce 'b': worker 0 waits in 'b' for worker 1, worker 1 in 'c' for worker 0
    res = run_pslaunch(["-n", "2", "-s", "0", "--no-dashboard", "--env", "SKIP:1", "--stall-warn", "1",
                        "--stall-timeout", "3", "--timeout", "60", "python", SKIPPER], timeout=90)
    assert res.returncode == 86, res.stderr
    assert re.search(r"\[worker\.0@localhost\] worker 0: stalled: allreduce of key 'b' \(version 0\) has waited 1 s "
                     r"\(PSLAUNCH_STALL_WARN=1\) for worker 1 on 127\.0\.0\.1; every worker must run the same "
                     r"collectives", res.stderr), res.stderr
    assert re.search(r"\[worker\.1@localhost\] worker 1: stalled: allreduce of key 'c' \(version 0\)", res.stderr)
    assert re.search(r"root cause: worker \d: stalled: allreduce of key '[bc]' .* \(PSLAUNCH_STALL_TIMEOUT=3\) .* is in "
                     r"<module> \(skip_collective\.py:\d+\) in allreduce", res.stderr), res.stderr
    assert not wait_gone(SKIPPER)


def test_the_same_collectives_on_every_rank_are_no_stall(tmp_path):
    res = run_pslaunch(["-n", "2", "-s", "0", "--no-dashboard", "--stall-warn", "1", "--stall-timeout", "3",
                        "--timeout", "60", "python", SKIPPER], timeout=90)
    assert res.returncode == 0 and "stalled" not in res.stderr, res.stderr
    assert sorted(re.findall(r"OK (\d)", res.stdout)) == ["0", "1"], res.stdout


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_stall_timeout_is_refused_before_anything_starts(tmp_path, value):
    res = run_pslaunch(["-n", "2", "--stall-timeout", value, "--dry-run", "python", HELPER, str(tmp_path)], timeout=30)
    assert res.returncode == 2 and f"--stall-timeout must be >= 0 seconds (0: never), got {value}" in res.stderr, res.stderr


def test_a_job_started_by_hand_with_the_variables_names_its_stall_and_ends_at_the_timeout(tmp_path):
    import os
    import subprocess

    from testkit import free_port, reap

    port, procs = free_port(), []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    base.update(PYTHONPATH=str(REPO), DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_SERVER="1",
                DMLC_NUM_WORKER="2", PSLAUNCH_STALL_WARN="1", PSLAUNCH_STALL_TIMEOUT="3", STEPS="5",
                STALL="1:2:compute:100")
    try:
        for index, role in enumerate(["scheduler", "server", "worker", "worker"]):
            with open(tmp_path / f"{index}.{role}.log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, HELPER, str(tmp_path)], env={**base, "DMLC_ROLE": role},
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        # all but the sleeping worker (rank 1, whichever process registered second) end at once, each
        # naming the stall; that one ends when it wakes
        codes = [procs[i].wait(timeout=40) for i in range(2)]
        deadline = time.monotonic() + 20
        while all(p.poll() is None for p in procs[2:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes += [p.poll() for p in procs[2:] if p.poll() is not None]
    finally:
        reap(procs)
    logs = {path.name.split(".")[1] + path.name[0]: path.read_text() for path in tmp_path.glob("*.log")}
    assert len(codes) == 3 and all(code != 0 for code in codes), logs
    logs["worker0"] = next(text for text in logs.values() if "psnode worker 0 " in text)
    server = logs["server1"]
    assert re.search(r"server 0: stalled: round 3 of key \d+ and \d+ more has waited 1 s \(PSLAUNCH_STALL_WARN=1\) for "
                     r"worker 1 on 127\.0\.0\.1; worker 0 pushed", server), server
    said = (r"server 0: stalled: round 3 of key \d+ and \d+ more has waited 3 s \(PSLAUNCH_STALL_TIMEOUT=3\) for worker 1 "
            r"on 127\.0\.0\.1; worker 0 pushed; the job ends \(--stall-timeout\)")
    assert re.search(r"psnode server \(pid \d+\): error: " + said, server), server
    for name in ("scheduler0", "worker0"):
        assert re.search(r"ended because a peer failed: server 0 on 127\.0\.0\.1:\d+ failed: " + said, logs[name]), logs
    # the worker that waits said the stall in its own log as it happened
    assert re.search(r"worker 0 waits on server 0: stalled: round 3 of key", logs["worker0"]), logs["worker0"]


def test_the_metrics_count_the_rounds_stalled_now(tmp_path):
    import urllib.request

    from testkit import free_port
    from testkit.launcher import reaped, start_pslaunch

    # worker 1 sleeps 6 s before its pushes of step 2: the servers' gauge rises while the rounds wait
    port = free_port()
    args = ["-n", "2", "-s", "2", "--no-dashboard", *ENV, "--env", "STEPS:4", "--env", "STALL:1:2:compute:6",
            "--stall-warn", "1", "--metrics-port", str(port), "--timeout", "60", "python", HELPER, str(tmp_path)]
    stalled = []
    with reaped(start_pslaunch(args), str(tmp_path)) as proc:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                    text = reply.read().decode()
                stalled += [float(v) for v in re.findall(r'^pslaunch_server_stalled_rounds\{[^}]*\} (\S+)$', text, re.M)]
            except OSError:
                pass  # not listening yet, or the job just ended
            time.sleep(0.3)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert stalled and max(stalled) >= 1 and stalled[0] == 0, stalled


def test_over_ssh_the_stalled_worker_is_asked_for_its_stack_through_its_guard(sshd, tmp_path):
    # worker 1 on 127.0.0.3 sleeps 100 s before its pushes of step 2; its guard delivers the stack signal
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    res = run_pslaunch(["-n", "2", "-s", "2", "-H", hosts, *sshd.ssh_flags(), "--no-dashboard", *ENV, "--env",
                        "STEPS:4", "--env", "STALL:1:2:compute:100", "--env", f"PYTHONPATH:{REPO}", "--stall-warn",
                        "1", "--stall-timeout", "3", "--timeout", "60", "python", HELPER, str(tmp_path)], timeout=90)
    assert res.returncode == 86, res.stderr
    assert re.search(r"root cause: server \d: stalled: round 3 of key .* worker\.1@127\.0\.0\.3 \(worker rank 1 .*\) is "
                     r"in maybe_die \(replace_sync\.py:\d+\)\n", res.stderr), res.stderr
    assert re.search(r"pslaunch:   \| " + STACK_LINE, res.stderr), res.stderr
    assert not wait_gone(str(tmp_path))


def test_the_timeline_shows_each_stall_over_the_time_it_waited(tmp_path):
    # worker 1 sleeps 3 s before its pushes of step 3, and again before the barrier of step 4
    trace = tmp_path / "trace.json"
    res = _job(tmp_path, "--stall-warn", "1", "--timeline", str(trace),
               env=["BARRIER_EVERY:2", "STALL:1:3:compute:3,1:3:marked:3"])
    assert res.returncode == 0, res.stderr
    events = json.loads(trace.read_text())
    stalls = [e for e in events if e.get("ph") == "X" and e["name"].startswith("stalled ")]
    rounds = [e for e in stalls if re.match(r"stalled round 4 of key \d+ and \d+ more for worker 1$", e["name"])]
    barriers = [e for e in stalls if re.match(r"stalled barrier \d+ of the workers for worker 1$", e["name"])
                and e["cat"] == "scheduler"]
    assert len(rounds) == 2 and {e["cat"] for e in rounds} == {"server"}, stalls  # once per server
    assert len(barriers) == 1, stalls
    assert all(e["dur"] >= 1_000_000 for e in rounds + barriers), stalls  # over the second it waited, at least
