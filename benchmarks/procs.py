"""Starting, waiting for and reaping the processes of one benchmark job.

Every process is started with an argv list in its own session (so it and anything it starts can be
signalled as a group), with stdout and stderr going to a log file. Every wait has a deadline; when a
job ends, successfully or not, every process still alive gets TERM, a grace period, then KILL, and
is reaped. Failures are data: ``JobFailed`` names the process, its exit code or signal and the last
lines of its log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JobFailed", "ProcessGroup", "free_port", "tail"]


class JobFailed(Exception):
    """A process of a benchmark job failed or ran past its deadline; the message says which and how."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(path: Path, lines: int = 12) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessGroup:
    """The processes of one job; use as a context manager so they are always reaped.

    Not thread-safe: one driver thread starts and waits.
    """

    def __init__(self, log_dir: Path, grace_s: float = 3.0) -> None:
        self.log_dir = log_dir
        self.grace_s = grace_s
        self._procs: list[_Proc] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        """Start ``argv`` with exactly ``env``; its output goes to ``<log_dir>/<name>.log``."""
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs.append(_Proc(name, popen, log))

    def log_of(self, name: str) -> Path:
        """The log file of the process called ``name``."""
        return self.log_dir / f"{name}.log"

    def wait(self, names: list[str], deadline: float) -> None:
        """Wait until every process in ``names`` has exited 0, by ``deadline`` (``time.monotonic``).

        Any other process of the group dying with a non-zero code first is a failure too: a dead
        server must not turn into a wait for the whole deadline.

        Raises:
            JobFailed: one exited non-zero (the first one seen), or the deadline passed.
        """
        pending = [p for p in self._procs if p.name in names]
        while True:
            for proc in self._procs:
                code = proc.popen.poll()
                if code is not None and code != 0:
                    raise JobFailed(
                        f"{proc.name} (pid {proc.popen.pid}) failed with {_describe(code)}; "
                        f"last lines of {proc.log}:\n{tail(proc.log)}"
                    )
            pending = [p for p in pending if p.popen.poll() is None]
            if not pending:
                return
            if time.monotonic() > deadline:
                who = ", ".join(f"{p.name} (pid {p.popen.pid})" for p in pending)
                first = pending[0]
                raise JobFailed(
                    f"still running at the deadline: {who}; last lines of {first.log}:\n{tail(first.log)}"
                )
            time.sleep(0.05)

    def stop_all(self) -> None:
        """TERM every live process group, wait ``grace_s``, KILL the rest, and reap them all."""
        live = [p for p in self._procs if p.popen.poll() is None]
        for proc in live:
            _signal_group(proc.popen, signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        for proc in live:
            try:
                proc.popen.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.popen, signal.SIGKILL)
                proc.popen.wait(timeout=10)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
