"""Job control: Ctrl-Z stops the whole job and fg continues it; stopped processes still stop at once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from testkit.launcher import REPO, backend_launch, helper, processes_with, reaped, wait_for_records, wait_gone


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "gone"


def _wait_states(pids: list[int], wanted: set[str], timeout: float = 20) -> dict[int, str]:
    """Wait until every pid is in one of the ``wanted`` states; returns the states seen last."""
    deadline = time.monotonic() + timeout
    while True:
        states = {pid: _state(pid) for pid in pids}
        if all(s in wanted for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def _role_job(out, *extra) -> list[str]:
    return ["-n", "2", "-s", "1", "--command-for-all-roles", "--shutdown-grace", "0.3",
            "--env-server", "SLEEP_scheduler:forever", "--env-server", "SLEEP_server:forever", *extra,
            sys.executable, helper("role.py"), str(out)]


@pytest.mark.parametrize("backend", ["local", "ssh", "mpi", "slurm", "sge"])
def test_a_stopped_process_gets_sigcont_with_sigterm_so_teardown_does_not_wait_out_the_grace(
        backend, request, tmp_path, marker):
    launch = backend_launch(backend, request, tmp_path)
    # With a 300 s grace, only SIGCONT lets the stopped worker take its SIGTERM within the time limit.
    res = launch.run(_role_job(tmp_path / "out", *launch.args, "--stop-grace", "300",
                               "--env-worker", "STOP_SELF_worker_0:1", "--env-worker", "SLEEP_worker_1:1",
                               "--env-worker", "EXIT_worker_1:9") + [marker], timeout=60)
    assert res.returncode == 9, res.stderr
    assert "root cause: worker.1@" in res.stderr
    row = next(line for line in res.stderr.splitlines() if line.startswith("| worker    |    0 |"))
    assert "stopped by pslaunch" in row and "SIGKILL" not in row, res.stderr
    # mpirun (and Slurm's step, through the rank shim) may continue a stopped process before its
    # SIGTERM arrives: the worker may finish its own run first
    assert "SIGTERM" in row or (backend in ("mpi", "slurm") and "| 0 " in row), res.stderr
    assert wait_gone(marker, 10) == []


@pytest.mark.parametrize("backend", ["local", "mpi", "slurm", "sge"])
def test_a_process_ending_slowly_after_sigterm_is_reported_with_its_own_exit_status(backend, request, tmp_path, marker):
    # mpirun, told to stop with a SIGTERM of its own, killed the ranks 1 s later and lost their statuses
    launch = backend_launch(backend, request, tmp_path)
    res = launch.run(_role_job(tmp_path / "out", *launch.args, "--stop-grace", "30", "--env-server", "TERM_DELAY_server:2",
                               "--env-worker", "SLEEP_worker_0:forever", "--env-worker", "SLEEP_worker_1:1",
                               "--env-worker", "EXIT_worker_1:9") + [marker], timeout=60)
    assert res.returncode == 9, res.stderr
    row = next(line for line in res.stderr.splitlines() if line.startswith("| server    |    0 |"))
    assert "| 75 " in row and "stopped by pslaunch" in row, res.stderr
    assert "no exit status" not in res.stderr, res.stderr
    assert wait_gone(marker, 10) == []


@pytest.mark.parametrize("backend", ["local", "ssh", "mpi", "slurm", "sge"])
def test_sigtstp_stops_every_process_of_the_job_and_sigcont_continues_them(backend, request, tmp_path, marker):
    out = tmp_path / "out"
    launch = backend_launch(backend, request, tmp_path)
    job = _role_job(out, *launch.args, "--env-worker", "SLEEP_worker:3") + [marker]
    with reaped(launch.start(job), marker) as proc:
        wait_for_records(out, 4, proc, timeout=60)
        pids = [json.loads(p.read_text())["pid"] for p in out.glob("*.json")]
        os.kill(proc.pid, signal.SIGTSTP)
        stopped = _wait_states(pids + [proc.pid], {"T", "t"})
        assert set(stopped.values()) <= {"T", "t"}, stopped
        time.sleep(4)  # longer than the workers' sleep: stopped, they cannot finish it
        still = _wait_states(pids + [proc.pid], {"T", "t"}, timeout=0)
        assert set(still.values()) <= {"T", "t"}, still
        os.kill(proc.pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr.decode()
        assert b"stopped 4 process(es) of the job (SIGTSTP)" in stderr and b"job continued" in stderr
    assert wait_gone(marker, 10) == []


def test_ctrl_z_in_a_terminal_stops_a_runtime_job_longer_than_its_heartbeat_timeout_and_fg_continues_it(
        tmp_path, marker):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: run scripts/test.sh (it installs tmux)")
    socket_name = f"pslaunch-{marker}"
    tmux = ["tmux", "-L", socket_name]
    # pslaunch is typed at the prompt, as a user does: the shell's job is pslaunch alone, and the
    # prompt shows the last exit status. Heartbeats every 0.2 s, death after 1 s of silence: a 3 s
    # stop would kill a job that counted it.
    setup = (f"cd {REPO}; export PYTHONPATH={REPO} STEPS=60 STEP_SLEEP=0.05; PS1='<rc=$?> '")
    command = (f"{sys.executable} -m launcher.cli -n 2 -s 1 --command-for-all-roles --env PS_HEARTBEAT_INTERVAL:0.2 "
               f"--env PS_HEARTBEAT_TIMEOUT:1 {sys.executable} {helper('steps_worker.py')} {marker}")
    pane = ""

    def capture() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-S", "-200", "-t", "job"], capture_output=True, text=True,
                              timeout=10).stdout

    def wait_for(text: str, timeout: float = 60, after: str = "") -> str:
        """The screen once ``text`` shows on it (after the last ``after``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = capture()
            if text in (screen[screen.rfind(after):] if after else screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{text!r} did not appear on the terminal:\n{capture()}")

    subprocess.run([*tmux, "new-session", "-d", "-s", "job", "-x", "220", "-y", "50", "bash --norc --noprofile"],
                   check=True, timeout=10)
    try:
        subprocess.run([*tmux, "send-keys", "-t", "job", setup, "Enter"], check=True, timeout=10)
        wait_for("<rc=0>")
        subprocess.run([*tmux, "send-keys", "-t", "job", command, "Enter"], check=True, timeout=10)
        wait_for("[worker.0@localhost] step 10")
        subprocess.run([*tmux, "send-keys", "-t", "job", "C-z"], check=True, timeout=10)
        pane = wait_for("Stopped")
        # SIGTSTP's status, 128 + 20; the live table was erased before the shell wrote its lines
        assert "<rc=148>" in wait_for("<rc=148>", after="Stopped"), pane
        job = [int(line.split(":")[0]) for line in processes_with(marker) if "steps_worker.py" in line]
        assert len(job) >= 5, processes_with(marker)  # pslaunch, the scheduler, the server, two workers
        states = _wait_states(job, {"T", "t"})
        assert set(states.values()) <= {"T", "t"}, states
        time.sleep(3)
        subprocess.run([*tmux, "send-keys", "-t", "job", "fg", "Enter"], check=True, timeout=10)
        pane = wait_for("<rc=", timeout=90, after="job continued")
        assert "<rc=0>" in pane[pane.rfind("job continued"):], pane
        assert "[worker.0@localhost] done 2" in pane, pane
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=10)
        for line in processes_with(marker):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert wait_gone(marker, 10) == [], pane


def test_a_sigcont_that_follows_sigint_as_timeouts_does_says_nothing_of_continuing(marker):
    # GNU timeout sends SIGCONT right after its signal; nothing was stopped, so nothing "continued"
    sleeper = "import time, sys; print('up', flush=True); time.sleep(60)"
    proc = subprocess.run(["timeout", "--preserve-status", "-s", "INT", "3", sys.executable, "-m", "launcher.cli",
                           "-n", "1", "-s", "0", "python", "-c", sleeper, marker],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert "pslaunch: root cause: pslaunch got SIGINT" in proc.stderr, proc.stderr
    assert "job continued" not in proc.stderr + proc.stdout, proc.stderr
    assert wait_gone(marker, 5) == []


def test_ctrl_c_pressed_again_and_again_while_the_job_stops_still_ends_with_the_table_and_the_root_cause(tmp_path, marker):
    # the first Ctrl-C stops the job; the others hurry it along (no grace period) but must not cut off
    # the summary table (a Ctrl-C landing after pslaunch gave its signals back once ended it with none)
    slow = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0))); " \
           "print('up', flush=True); time.sleep(60)"
    out = tmp_path / "stderr"
    with open(out, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "-n", "2", "-s", "1", "--stop-grace", "5",
                                 "python", "-c", slow, marker], cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)
    try:
        assert proc.stdout.readline().endswith(b"up\n")
        while proc.poll() is None:  # Ctrl-C every 20 ms until pslaunch has ended
            os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.02)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    assert proc.returncode == 130, text
    assert "| role" in text and text.count("| worker ") == 2, text
    assert "pslaunch: root cause: pslaunch got SIGINT" in text and "pslaunch: interrupted" not in text, text
    assert wait_gone(marker, 10) == []
