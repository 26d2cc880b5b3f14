"""The local backend end to end: real processes, exit codes, root cause, teardown leaves nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from testkit.launcher import helper, processes_with, reaped, run_pslaunch, start_pslaunch, wait_for_records, wait_gone

TRICKY = ["--lr", "0.1 x", "it's", 'say "hi"', "$HOME", "back\\slash", "*", "", "ü"]
ROLE = helper("role.py")


def _job(out, *extra, n=2, s=1):
    """pslaunch flags for a job whose every role is role.py; scheduler and servers run until stopped."""
    return ["-n", str(n), "-s", str(s), "--launcher", "local", "--command-for-all-roles", "--shutdown-grace", "0.3",
            "--stop-grace", "2", "--env-server", "SLEEP_scheduler:forever", "--env-server", "SLEEP_server:forever",
            *extra, sys.executable, ROLE, str(out)]


def _records(out):
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_every_rank_runs_with_its_role_contract_and_exact_arguments(tmp_path, monkeypatch):
    out = tmp_path / "out"
    env = dict(os.environ, FORWARDED="from launcher", CHECK_VARS="FORWARDED,ONLY_W,ONLY_S")
    res = run_pslaunch(_job(out, "--env", "FORWARDED", "--env", "CHECK_VARS", "--env-worker", "ONLY_W:w",
                            "--env-server", "ONLY_S=s", n=3, s=2) + TRICKY, env=env)
    assert res.returncode == 0, res.stderr
    rec = _records(out)
    assert sorted(rec) == ["scheduler.0", "server.0", "server.1", "worker.0", "worker.1", "worker.2"]
    for name, r in rec.items():
        role, rank = name.split(".")
        assert r["argv"] == TRICKY
        assert r["env"]["DMLC_ROLE"] == role and r["env"]["PSLAUNCH_RANK"] == rank
        assert r["env"]["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert r["env"]["DMLC_NUM_WORKER"] == "3" and r["env"]["DMLC_NUM_SERVER"] == "2"
        assert r["checked"]["FORWARDED"] == "from launcher"
        assert r["checked"]["ONLY_W"] == ("w" if role == "worker" else None)
        assert r["checked"]["ONLY_S"] == ("s" if role != "worker" else None)
    ports = {r["env"]["DMLC_PS_ROOT_PORT"] for r in rec.values()}
    assert len(ports) == 1 and 1 <= int(ports.pop()) <= 65535
    assert [rec[f"worker.{i}"]["env"]["PSLAUNCH_LOCAL_RANK"] for i in range(3)] == ["0", "1", "2"]
    assert "[worker.2@localhost] worker 2 started" in res.stdout
    assert "stopped by pslaunch" in res.stderr  # the summary table: servers stopped after the grace period


def test_first_failure_stops_everything_becomes_the_exit_code_and_is_named_with_its_last_lines(tmp_path, marker):
    out = tmp_path / "out"
    # worker 0 sleeps until stopped: the job ends only because the failure stopped it
    res = run_pslaunch(_job(out, "--env-worker", "SLEEP_worker:forever", "--env-worker", "SLEEP_worker_1:0.2",
                            "--env-worker", "EXIT_worker_1:7") + [marker], timeout=60)
    assert res.returncode == 7
    assert "root cause: worker.1@localhost (worker rank 1 on localhost, pid " in res.stderr
    assert ") failed first: exit code 7" in res.stderr
    assert "pslaunch:   | worker 1 started" in res.stderr
    assert wait_gone(marker, 5) == []


def test_a_worker_killed_by_a_signal_gives_128_plus_the_signal(tmp_path, marker):
    res = run_pslaunch(_job(tmp_path, "--env-worker", "SIGNAL_worker_0:9", "--env-worker", "SLEEP_worker_1:30") + [marker])
    assert res.returncode == 128 + 9
    assert "worker.0@localhost" in res.stderr and "failed first: signal SIGKILL" in res.stderr
    assert wait_gone(marker, 5) == []


def test_a_server_that_exits_before_the_workers_finish_fails_the_job(tmp_path, marker):
    res = run_pslaunch(_job(tmp_path, "--env-worker", "SLEEP_worker:30", "--env-server", "SLEEP_server_0:0.2") + [marker])
    assert res.returncode == 1
    assert "root cause: server.0@localhost" in res.stderr
    assert "exited with code 0 before the workers finished" in res.stderr
    assert wait_gone(marker, 5) == []


def test_servers_that_exit_by_themselves_after_the_workers_make_a_clean_success(tmp_path):
    res = run_pslaunch(["-n", "2", "-s", "2", "--launcher", "local", "--command-for-all-roles", "--shutdown-grace", "5",
                        "--env-server", "SLEEP_server:0.5", "--env-server", "SLEEP_scheduler:0.5",
                        sys.executable, ROLE, str(tmp_path)])
    assert res.returncode == 0, res.stderr
    assert "stopped by pslaunch" not in res.stderr


def test_timeout_stops_the_job_with_exit_124(tmp_path, marker):
    res = run_pslaunch(_job(tmp_path, "--timeout", "1", "--env-worker", "SLEEP_worker:forever") + [marker])
    assert res.returncode == 124
    assert "root cause: the job ran longer than --timeout 1 s" in res.stderr
    assert wait_gone(marker, 5) == []


def test_a_command_that_cannot_start_is_a_clear_error_with_exit_5():
    res = run_pslaunch(["-n", "1", "--launcher", "local", "--command-for-all-roles", "no-such-program-xyz", "a"])
    assert res.returncode == 5
    assert "cannot start scheduler.0@localhost: 'no-such-program-xyz'" in res.stderr


def test_log_dir_keeps_one_file_per_process(tmp_path):
    logs = tmp_path / "logs"
    res = run_pslaunch(_job(tmp_path / "out", "--log-dir", str(logs), "-q"))
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    processes = ["scheduler.0@localhost", "server.0@localhost", "worker.0@localhost", "worker.1@localhost"]
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        ["pslaunch.log", "summary.json", *(f"{n}.log" for n in processes), *(f"{n}.stderr.log" for n in processes)])
    assert (logs / "worker.1@localhost.log").read_text() == "worker 1 started\n"
    # quiet on the screen, the log dir still has pslaunch's summary, plain, and the JSON one
    assert "| worker    |    1 | localhost |" in (logs / "pslaunch.log").read_text()
    assert json.loads((logs / "summary.json").read_text())["exit_code"] == 0


def test_log_dir_has_files_for_a_silent_process_stderr_alone_and_the_root_cause(tmp_path):
    code = ("import os, sys, time; r = os.environ['DMLC_WORKER_ID']\n"
            "if r == '0': time.sleep(60)\n"  # says nothing until stopped
            "print('out', r); print('err', r, file=sys.stderr); sys.exit(9)")
    res = run_pslaunch(["-n", "2", "-s", "0", "--log-dir", str(tmp_path), "python", "-c", code])
    assert res.returncode == 9, res.stderr
    assert (tmp_path / "worker.0@localhost.log").read_text() == ""  # silent, but there
    assert (tmp_path / "worker.0@localhost.stderr.log").read_text() == ""
    # both streams (two pipes: each in its order, with no order between them)
    assert sorted((tmp_path / "worker.1@localhost.log").read_text().splitlines()) == ["err 1", "out 1"]
    assert (tmp_path / "worker.1@localhost.stderr.log").read_text() == "err 1\n"
    own = (tmp_path / "pslaunch.log").read_text()
    assert "pslaunch: root cause: worker.1@localhost" in own and "pslaunch:   | err 1" in own and "\x1b[" not in own
    assert json.loads((tmp_path / "summary.json").read_text())["root_cause"]["process"] == "worker.1@localhost"


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129),
                                         (signal.SIGKILL, None)])
def test_signal_to_pslaunch_leaves_no_process_even_one_that_ignores_sigterm(tmp_path, marker, sig, code):
    out = tmp_path / "out"
    with reaped(start_pslaunch(_job(out, "--stop-grace", "1", "--env-worker", "SLEEP_worker:forever",
                                    "--env-worker", "IGNORE_TERM_worker:1") + [marker]), marker) as proc:
        wait_for_records(out, 4, proc, timeout=20)
        assert len(processes_with(marker)) >= 4
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=20)
        if code is not None:
            assert proc.returncode == code
            assert f"root cause: pslaunch got {signal.Signals(sig).name}" in stderr.decode()
            assert "stopped by pslaunch" in stderr.decode()  # the summary table came out
        assert wait_gone(marker, 10) == []


def test_env_values_never_appear_in_process_listings(tmp_path, marker):
    out = tmp_path / "out"
    secret = "s3cr3t-" + marker
    # --env NAME forwards pslaunch's own value: the secret is on no command line, pslaunch's included
    env = dict(os.environ, API_TOKEN=secret)
    proc = start_pslaunch(_job(out, "--env", "API_TOKEN", "--env", "CHECK_VARS:API_TOKEN",
                               "--env-worker", "SLEEP_worker:forever") + [marker], env=env)
    try:
        wait_for_records(out, 4, proc, timeout=20)
        listing = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, timeout=10).stdout
        assert marker in listing
        assert secret not in listing
        assert _records(out)["worker.0"]["checked"]["API_TOKEN"] == secret
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=20)
        assert secret.encode() not in stdout + stderr
        assert wait_gone(marker, 10) == []


def test_output_lines_are_prefixed_whole_with_bad_bytes_replaced_and_progress_collapsed(tmp_path):
    res = run_pslaunch(["-n", "1", "--launcher", "local", "--command-for-all-roles", "--shutdown-grace", "0.2",
                        sys.executable, helper("noisy.py")])
    worker = [line for line in res.stdout.splitlines() if line.startswith("[worker.0@localhost]")]
    assert worker[:2] == ["[worker.0@localhost] first half second half", "[worker.0@localhost] bad \ufffd\ufffd bytes"]
    assert worker[-2:] == ["[worker.0@localhost] progress 100%", "[worker.0@localhost] no newline at the end"]
    # how many progress states show depends on how the writes were read: never more than the three
    progress = worker[2:-1]
    assert set(progress) <= {"[worker.0@localhost] progress 10%", "[worker.0@localhost] progress 50%",
                             "[worker.0@localhost] progress 100%"}


def test_python_print_reaches_the_screen_while_the_worker_runs(tmp_path, marker):
    script = tmp_path / "chat.py"
    script.write_text("import time\nprint('first line, no flush')\ntime.sleep(60)\n")
    with reaped(start_pslaunch(["-n", "1", "-s", "1", "--launcher", "local", "python", str(script), marker]),
                marker) as proc:
        # block-buffered, the line would only come at exit, 60 s later
        line = _read_line_within(proc, "[worker.0@localhost] first line, no flush", 30)
        assert line
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=20)
    assert wait_gone(marker, 10) == []


def _read_line_within(proc, wanted: str, timeout: float) -> str:
    import selectors

    deadline = time.monotonic() + timeout
    buffered = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(0.2):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buffered += chunk
                for line in buffered.decode(errors="replace").splitlines():
                    if line == wanted:
                        return line
    raise AssertionError(f"{wanted!r} did not arrive within {timeout} s; got {buffered!r}")


def test_a_line_of_300_kib_stays_one_prefixed_line(tmp_path):
    script = tmp_path / "long.py"
    script.write_text("import sys\nsys.stdout.write('a' * 300 * 1024 + 'END\\n')\nprint('after')\n")
    res = run_pslaunch(["-n", "1", "-s", "1", "--launcher", "local", "python", str(script)])
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("[worker.0@localhost]")]
    assert lines == ["[worker.0@localhost] " + "a" * 300 * 1024 + "END", "[worker.0@localhost] after"]


def test_a_log_dir_that_cannot_be_created_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = run_pslaunch(["-n", "1", "--launcher", "local", "--log-dir", str(blocker / "logs"), "python", "-c", "pass"])
    assert res.returncode == 2
    assert res.stderr == f"pslaunch: error: --log-dir {blocker / 'logs'}: cannot create it: Not a directory\n"


def test_a_missing_script_is_exit_2_before_any_process_starts(tmp_path):
    res = run_pslaunch(["-n", "2", "-s", "1", "--launcher", "local", "python", "no_such_train.py", "--epochs", "3"],
                       cwd=str(tmp_path))
    assert res.returncode == 2
    assert res.stderr == (f"pslaunch: error: COMMAND's script is missing: 'no_such_train.py' is not a file in {tmp_path} "
                          "(the script of worker.0@localhost); nothing was started\n")
    assert res.stdout == ""


def test_an_interpreter_that_cannot_start_is_named_with_the_flag_that_chose_it(tmp_path):
    res = run_pslaunch(["-n", "1", "--python", str(tmp_path / "no-python"), "python", "-c", "pass"])
    assert res.returncode == 5
    assert res.stderr == (f"pslaunch: error: cannot start scheduler.0@localhost: '{tmp_path / 'no-python'}': "
                          "No such file or directory (the interpreter --python names)\n")
    other = run_pslaunch(["-n", "1", "-s", "0", str(tmp_path / "no-program")])  # not --python's: no mention
    assert other.returncode == 5 and "--python" not in other.stderr, other.stderr


def test_ranks_and_timestamps_shape_the_console_while_the_log_dir_keeps_everything(tmp_path):
    code = "import os; print('hello from', os.environ['DMLC_WORKER_ID'])"
    res = run_pslaunch(["-n", "3", "-s", "0", "--ranks", "0,2", "--timestamps", "--log-dir", str(tmp_path),
                        "python", "-c", code])
    assert res.returncode == 0, res.stderr
    shown = [line for line in res.stdout.splitlines() if "hello from" in line]
    assert len(shown) == 2 and all(re.match(r"\d\d:\d\d:\d\d\.\d{3} \[worker\.[02]@localhost\] hello from [02]$", line)
                                   for line in shown), res.stdout
    assert (tmp_path / "worker.1@localhost.log").read_text() == "hello from 1\n"
    wrong = run_pslaunch(["-n", "3", "--ranks", "1,5", "true"])
    assert wrong.returncode == 2
    assert wrong.stderr == "pslaunch: error: --ranks names worker rank(s) 5, but the job has 3 worker(s): ranks 0..2\n"
