"""A test kit: start a whole job (scheduler, servers, worker scripts) on 127.0.0.1 and always reap it.

    with LocalJob(num_workers=3, num_servers=2, worker=["tests/kvcore/dist_scripts/sums.py"]) as job:
        results = job.wait(timeout=60)          # every process's exit code and output
        assert all(r.returncode == 0 for r in results)

Every process runs in its own session (process group) with the environment contract of
docs/env.md, on a free port, its output in a temporary file. Leaving the ``with`` block kills
whatever is still running (TERM, a grace period, then KILL of the whole process group), also
when the test failed. ``free_port()`` and ``job_env()`` help tests that start processes themselves.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["LocalJob", "ProcessResult", "free_port", "job_env", "reap"]

_ROOT = str(Path(__file__).resolve().parent.parent)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(num_workers: int, num_servers: int, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment contract for a job on 127.0.0.1 (short heartbeats for tests), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    env.update(
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(port),
        DMLC_NUM_WORKER=str(num_workers),
        DMLC_NUM_SERVER=str(num_servers),
        DMLC_NODE_HOST="127.0.0.1",
        PS_HEARTBEAT_INTERVAL="0.5",
        PS_HEARTBEAT_TIMEOUT="10",
        PSLAUNCH_REGISTER_TIMEOUT="30",
        PSLAUNCH_JOB_ID=f"test-{port}",
        PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


@dataclass
class ProcessResult:
    """How one process of the job ended."""

    role: str
    index: int
    returncode: int | None
    output: str

    def __str__(self) -> str:
        return f"{self.role} {self.index} exited {self.returncode}:\n{self.output[-3000:]}"


class _Proc:
    def __init__(self, role: str, index: int, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.role = role
        self.index = index
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.popen = subprocess.Popen(list(argv), env=dict(env), stdout=self.log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, cwd=_ROOT)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def result(self) -> ProcessResult:
        return ProcessResult(self.role, self.index, self.popen.returncode, self.output())


def reap(popens: Sequence[subprocess.Popen], grace: float = 2.0) -> None:
    """Stop every process group still running: TERM, ``grace`` seconds, then KILL; wait for all."""
    for popen in popens:
        if popen.poll() is None:
            _signal_group(popen, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for popen in popens:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for popen in popens:
        if popen.poll() is None:
            _signal_group(popen, signal.SIGKILL)
            popen.wait()
        else:  # the leader is gone; make sure nothing it spawned lingers in its group
            _signal_group(popen, signal.SIGKILL)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalJob:
    """A job on 127.0.0.1: the bundled scheduler and servers plus ``worker`` argv per worker.

    Args:
        num_workers, num_servers: the job's size.
        worker: argv after ``python`` for every worker (a script path and its arguments), or None to
            start no workers (the test starts them).
        env: extra variables for every process; ``worker_env[i]`` extra ones for worker i.
        start_scheduler, start_servers: set False to leave a role out (e.g. to test a missing node).
    """

    def __init__(
        self,
        num_workers: int,
        num_servers: int,
        worker: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        worker_env: Sequence[Mapping[str, str]] | None = None,
        start_scheduler: bool = True,
        start_servers: int | None = None,
        start_workers: int | None = None,
    ) -> None:
        self.port = free_port()
        self.env = job_env(num_workers, num_servers, self.port, env)
        self.procs: list[_Proc] = []
        self.num_workers = num_workers
        self._plan = (worker, worker_env, start_scheduler,
                      num_servers if start_servers is None else start_servers,
                      num_workers if start_workers is None else start_workers)

    def __enter__(self) -> "LocalJob":
        worker, worker_env, start_scheduler, servers, workers = self._plan
        try:
            if start_scheduler:
                self.start("scheduler", 0, [sys.executable, "-m", "psnode", "scheduler"])
            for i in range(servers):
                self.start("server", i, [sys.executable, "-m", "psnode", "server"])
            if worker is not None:
                for i in range(workers):
                    extra = dict(worker_env[i]) if worker_env else {}
                    self.start("worker", i, [sys.executable, *worker], {"DMLC_ROLE": "worker", **extra})
        except BaseException:
            self.close()
            raise
        return self

    def start(self, role: str, index: int, argv: Sequence[str], extra: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start one more process of the job (``DMLC_ROLE=role`` unless ``extra`` says otherwise)."""
        env = dict(self.env)
        env["DMLC_ROLE"] = role
        env.update(extra or {})
        if env.get("DMLC_ROLE") == "":
            del env["DMLC_ROLE"]
        proc = _Proc(role, index, argv, env)
        self.procs.append(proc)
        return proc.popen

    def of(self, role: str, index: int = 0) -> subprocess.Popen:
        """The process started as ``role`` number ``index``."""
        for proc in self.procs:
            if proc.role == role and proc.index == index:
                return proc.popen
        raise KeyError(f"no {role} {index} was started")

    def wait(self, timeout: float) -> list[ProcessResult]:
        """Wait for every process to exit; on timeout kill them all and raise with their output.

        Raises:
            TimeoutError: some process was still running after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [f"{p.role} {p.index}" for p in self.procs if p.popen.poll() is None]
                self.close()
                details = "\n".join(str(p.result()) for p in self.procs)
                raise TimeoutError(f"still running after {timeout:g} s: {', '.join(running)}\n{details}") from None
        return self.results()

    def results(self) -> list[ProcessResult]:
        """Each process's role, index, exit code (None while running) and output so far."""
        for proc in self.procs:
            proc.popen.poll()
        return [proc.result() for proc in self.procs]

    def close(self) -> None:
        """Kill what still runs (whole process groups) and reap it."""
        reap([p.popen for p in self.procs])

    def __exit__(self, *exc: object) -> None:
        self.close()
        for proc in self.procs:
            proc.log.close()
