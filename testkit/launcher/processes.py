"""pslaunch runs of the tests and what they leave: starting, reaping, looking at processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from launcher.on_node.process_groups import leader_start

__all__ = ["HELPERS", "REPO", "PSLAUNCH", "Result", "LiveProcess", "StderrWatch", "ancestors", "cmdline", "job_worker",
           "live_processes", "processes_with", "wait_gone", "start_pslaunch", "wait_for_records", "reaped",
           "run_pslaunch", "helper"]

HELPERS = Path(__file__).resolve().parents[2] / "tests" / "launcher" / "helpers"
REPO = Path(__file__).resolve().parents[2]
PSLAUNCH = [sys.executable, "-m", "launcher.cli"]


def ancestors(pid: int) -> list[int]:
    """The parent, grandparent, ... of ``pid`` up to init, from /proc."""
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            break
        chain.append(pid)
    return chain


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class LiveProcess:
    """A process /proc listed, not a zombie: its pid, its parent's and its argv."""

    pid: int
    ppid: int
    argv: tuple[bytes, ...]

    @property
    def command(self) -> str:
        return b" ".join(self.argv).decode("utf-8", "replace")

    def environ(self) -> dict[bytes, bytes]:
        """Its environment as it started (empty once it is gone)."""
        try:
            with open(f"/proc/{self.pid}/environ", "rb") as fh:
                return dict(item.partition(b"=")[::2] for item in fh.read().split(b"\0") if item)
        except OSError:
            return {}


def live_processes() -> list[LiveProcess]:
    """Every live (non-zombie) process but this one, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = tuple(fh.read().split(b"\0")[:-1])
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            found.append(LiveProcess(int(entry), int(fields[1]), argv))
    return found


def job_worker(tag: str, rank: int, min_age: float = 0.0, attempt: int | None = None) -> int | None:
    """The pid of the live worker ``rank`` of the job whose script's arguments hold ``tag`` (an
    argument itself, not pslaunch's), once it has run ``min_age`` seconds and, when ``attempt`` is
    given, of that restart of the job (``PSLAUNCH_RESTART_COUNT``); else None."""
    for proc in live_processes():
        if tag.encode() not in proc.argv or b"launcher.cli" in proc.argv:
            continue
        environ = proc.environ()
        if (environ.get(b"DMLC_ROLE") == b"worker" and environ.get(b"DMLC_WORKER_ID") == str(rank).encode()
                and (attempt is None or environ.get(b"PSLAUNCH_RESTART_COUNT") == str(attempt).encode())
                and (min_age <= 0 or _age(proc.pid) >= min_age)):
            return proc.pid
    return None


def job_server(tag: str, min_age: float = 0.0, replica: bool = False) -> int | None:
    """The pid of a live server (``replica``: a replica, ``--server-replicas``) of the job whose every
    process has ``PSLAUNCH_BENCH_TAG=tag`` in its environment (``--env``), once it has run ``min_age``
    seconds; else None."""
    for proc in live_processes():
        if b"psnode" not in proc.argv:
            continue
        environ = proc.environ()
        if (environ.get(b"PSLAUNCH_BENCH_TAG") == tag.encode() and environ.get(b"DMLC_ROLE") == b"server"
                and (environ.get(b"PSLAUNCH_SERVER_REPLICA") == b"1") == replica
                and (min_age <= 0 or _age(proc.pid) >= min_age)):
            return proc.pid
    return None


def _age(pid: int) -> float:
    """Seconds since process ``pid`` started (0 once it is gone)."""
    started = leader_start(pid)
    try:
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return 0.0 if started is None else uptime - started / os.sysconf("SC_CLK_TCK")


def processes_with(text: str) -> list[str]:
    """Command lines of live (non-zombie) processes whose argv contains ``text``, from /proc."""
    return [f"{p.pid}: {p.command} " for p in live_processes() if text in p.command + " "]


def wait_gone(text: str, timeout: float = 10.0) -> list[str]:
    """Wait until no process carries ``text``; returns what is left after ``timeout`` (empty = gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with(text)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@dataclass
class Result:
    """A finished pslaunch run."""

    returncode: int
    stdout: str
    stderr: str


def start_pslaunch(args: list[str], cwd: str | None = None, env: dict | None = None) -> subprocess.Popen:
    """Start pslaunch with ``args`` in the background, in its own process group, its output piped.

    ``env`` (default: this process's environment) gets the repository put first on PYTHONPATH.
    The caller reaps it: see :func:`reaped`.
    """
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.Popen(PSLAUNCH + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=full_env, start_new_session=True)


class StderrWatch:
    """Reads a started pslaunch's stderr as it comes, so a test can wait for a line of it instead of
    sleeping a fixed time; ``finish`` waits for the process and returns all of it. It drains stdout
    too (one thread each: a full pipe would stop pslaunch), and owns both pipes: do not also call
    ``communicate``, which would take some of the lines."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, args=(proc.stderr, True), daemon=True),
                         threading.Thread(target=self._read, args=(proc.stdout, False), daemon=True)]
        for thread in self._threads:
            thread.start()

    def _read(self, stream, keep: bool) -> None:
        for chunk in iter(lambda: stream.read1(1 << 16), b""):
            if keep:
                with self._lock:
                    self._chunks.append(chunk)

    def text(self) -> str:
        with self._lock:
            return b"".join(self._chunks).decode("utf-8", "replace")

    def wait_for(self, pattern: str, timeout: float) -> bool:
        """True once ``pattern`` (a regex) is in the output; False if pslaunch ended or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.text()):
                return True
            if self.proc.poll() is not None:
                self._threads[0].join(5)
                return bool(re.search(pattern, self.text()))
            time.sleep(0.05)
        return False

    def finish(self, timeout: float) -> str:
        """Wait for pslaunch to end and return its whole stderr."""
        self.proc.wait(timeout)
        for thread in self._threads:
            thread.join(10)
        return self.text()


def wait_for_records(out: Path, count: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Wait until ``count`` role.py records (``*.json``) stand in ``out``: the job's processes started.

    Fails at once, with pslaunch's output, if pslaunch ends first, and after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while len(list(out.glob("*.json"))) < count:
        if proc.poll() is not None:
            raise AssertionError(f"pslaunch ended early: {proc.communicate()}")
        assert time.monotonic() < deadline, "the job's processes did not start"
        time.sleep(0.05)


@contextmanager
def reaped(proc: subprocess.Popen, marker: str):
    """Yield ``proc``; afterwards, pass or fail, kill its process group if it still runs and
    SIGKILL every process still carrying ``marker``, so that a failing test leaves nothing behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for line in processes_with(marker):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def run_pslaunch(args: list[str], timeout: float = 60, cwd: str | None = None, env: dict | None = None) -> Result:
    """Run pslaunch with ``args`` in a fresh process (its own group, killed on timeout)."""
    proc = start_pslaunch(args, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"pslaunch {args} did not finish within {timeout} s:\n{out.decode()}\n{err.decode()}") from None
    return Result(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def helper(name: str) -> str:
    """Path of a helper script in tests/launcher/helpers."""
    return str(HELPERS / name)
