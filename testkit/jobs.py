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
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from pscontract import PSLAUNCH_JOB_KEY, SETTINGS, contract_env, free_port, new_job_key
from testkit.processes import reap

__all__ = ["LocalJob", "ProcessResult", "JobFailed", "free_port", "job_env", "wait_catching"]

_ROOT = str(Path(__file__).resolve().parents[1])
_CONTRACT_PREFIXES = ("DMLC_", "PS_", "PSLAUNCH_")
_TEST_SETTINGS = {"PS_HEARTBEAT_INTERVAL": "0.5", "PS_HEARTBEAT_TIMEOUT": "10", "PSLAUNCH_REGISTER_TIMEOUT": "30"}


class JobFailed(Exception):
    """A process of a job failed or ran past its deadline; the message says which, how, and its last lines."""


def job_env(num_workers: int, num_servers: int, port: int, extra: Mapping[str, str] | None = None,
            role: str = "worker", rank: int = 0, test_settings: bool = True, root_uri: str = "127.0.0.1",
            node_host: str | None = None, job_key: str | None = None) -> dict[str, str]:
    """The environment of one process of a job on 127.0.0.1 (or the scheduler's ``root_uri``, this
    process's address ``node_host``, default the same), plus ``extra``.

    The contract is written by ``pscontract.contract_env``, its one writer: ``DMLC_LOCAL``,
    ``PS_VERBOSE`` and the names of its ``SETTINGS`` in ``extra`` go through it; other variables of
    ``extra`` are added as they are (a test may write a malformed contract on purpose). With
    ``test_settings`` heartbeats and registration are short, for tests. Workers get no fixed
    rank: the scheduler orders them, as for a job started by hand. ``job_key`` (64 hex digits) is
    the job's ``PSLAUNCH_JOB_KEY``; None starts the job without one (loopback only, unauthenticated).
    """
    extra = dict(extra or {})
    settings = {**(_TEST_SETTINGS if test_settings else {}), **{k: v for k, v in extra.items() if k in SETTINGS}}
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CONTRACT_PREFIXES)}
    env.update(contract_env(role=role, root_uri=root_uri, root_port=port, num_workers=num_workers,
                            num_servers=num_servers, job_id=f"test-{port}", rank=rank, local_rank=rank,
                            local_size=max(1, num_workers if role == "worker" else num_servers),
                            node_host=node_host or root_uri,
                            all_local=extra.pop("DMLC_LOCAL", "0") == "1", verbose=int(extra.pop("PS_VERBOSE", "0")),
                            fixed_rank=False, supervised=False, settings=settings))
    if job_key is not None:
        env[PSLAUNCH_JOB_KEY] = job_key
    env.update(PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p), PYTHONUNBUFFERED="1")
    env.update({k: v for k, v in extra.items() if k not in SETTINGS})
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
    def __init__(self, role: str, index: int, argv: Sequence[str], env: Mapping[str, str], log: Path | None,
                 cpu: int | None = None) -> None:
        self.role = role
        self.index = index
        self.path = log
        self.log = open(log, "w+b") if log is not None else tempfile.TemporaryFile(mode="w+b")
        # bound in the child before it runs a line of its program, so every thread it starts inherits it
        bind = None if cpu is None else lambda: os.sched_setaffinity(0, {cpu})
        self.popen = subprocess.Popen(list(argv), env=dict(env), stdout=self.log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, cwd=_ROOT, preexec_fn=bind)

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def result(self) -> ProcessResult:
        return ProcessResult(self.role, self.index, self.popen.returncode, self.output())

    def failure(self, how: str) -> str:
        lines = "\n".join(self.output().splitlines()[-12:])
        where = f" (log {self.path})" if self.path is not None else ""
        return f"{self.name} (pid {self.popen.pid}) {how}{where}; its last lines:\n{lines}"


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def wait_catching(popen: subprocess.Popen, signals: Sequence[int], timeout: float = 30) -> None:
    """Wait until ``popen`` has a handler installed for every one of ``signals`` (its ``SigCgt`` in
    /proc), so a test sends a signal only once the process handles it.

    Raises:
        AssertionError: the process exited first, or ``timeout`` seconds passed (naming the signals).
    """
    wanted = 0
    for sig in signals:
        wanted |= 1 << (int(sig) - 1)
    deadline = time.monotonic() + timeout
    while True:
        if popen.poll() is not None:
            raise AssertionError(f"pid {popen.pid} exited ({popen.returncode}) before it caught {list(signals)}")
        try:
            with open(f"/proc/{popen.pid}/status") as fh:
                caught = next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            caught = 0
        if caught & wanted == wanted:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {popen.pid} did not catch {list(signals)} within {timeout:g} s")
        time.sleep(0.02)


class LocalJob:
    """A job on 127.0.0.1: the bundled scheduler and servers plus ``worker`` argv per worker.

    Args:
        num_workers, num_servers: the job's size.
        worker: argv after ``python`` for every worker (a script path and its arguments), or None to
            start no workers (the test starts them).
        env: extra variables for every process (names of the contract's settings, such as
            ``PSLAUNCH_SAME_HOST``, go through ``contract_env``); ``worker_env[i]`` extra ones for worker i.
        start_scheduler, start_servers, start_workers: leave a role out, or start fewer (e.g. to test
            a missing node).
        scheduler, server: full argv of those roles (default: the bundled ``python -m psnode ROLE``);
            ``python``: the interpreter workers run under.
        log_dir: keep each process's output in ``<log_dir>/<role><index>.log`` (default: temporary files).
        test_settings: short heartbeats and registration (``job_env``); False keeps the runtime's
            defaults (the benchmarks).
        job_key: True (a fresh key, as pslaunch gives every job), a key of 64 hex digits, or None
            (no key: an unauthenticated job on loopback).
        root_uri: the scheduler's address (default 127.0.0.1); ``start(..., node_host=)`` gives a
            process another address of its own (a benchmark with nodes in network namespaces).
        cpu_bind: run each process on one core of those this process may use, in turn in the order
            they start (the scheduler, the servers, the workers, then any ``start``): a benchmark's
            placement that does not change from run to run (the kernel's may put two workers on one
            core while another idles). Linux only.
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
        scheduler: Sequence[str] | None = None,
        server: Sequence[str] | None = None,
        python: str = sys.executable,
        log_dir: Path | None = None,
        test_settings: bool = True,
        job_key: str | None | bool = True,
        root_uri: str = "127.0.0.1",
        cpu_bind: bool = False,
    ) -> None:
        self.port = free_port()
        self._cores = sorted(os.sched_getaffinity(0)) if cpu_bind else []
        self.root_uri = root_uri
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.procs: list[_Proc] = []
        self._extra = dict(env or {})
        self._log_dir = log_dir
        self._test_settings = test_settings
        self.job_key = new_job_key() if job_key is True else job_key or None
        self._plan = (worker, worker_env, start_scheduler,
                      num_servers if start_servers is None else start_servers,
                      num_workers if start_workers is None else start_workers,
                      list(scheduler or [sys.executable, "-m", "psnode", "scheduler"]),
                      list(server or [sys.executable, "-m", "psnode", "server"]), python)
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "LocalJob":
        worker, worker_env, start_scheduler, servers, workers, scheduler, server, python = self._plan
        try:
            if start_scheduler:
                self.start("scheduler", 0, scheduler)
            for i in range(servers):
                self.start("server", i, server)
            if worker is not None:
                for i in range(workers):
                    extra = dict(worker_env[i]) if worker_env else {}
                    self.start("worker", i, [python, *(a.replace("{index}", str(i)) for a in worker)], extra)
        except BaseException:
            self.close()
            raise
        return self

    def start(self, role: str, index: int, argv: Sequence[str], extra: Mapping[str, str] | None = None,
              node_host: str | None = None) -> subprocess.Popen:
        """Start one more process of the job (``DMLC_ROLE=role`` unless ``extra`` says otherwise;
        ``DMLC_ROLE=""`` starts it without the variable); ``node_host``: its own address when it is
        not the scheduler's."""
        contract_role = role if role in ("scheduler", "server", "worker") else "worker"
        env = job_env(self.num_workers, self.num_servers, self.port, {**self._extra, **(extra or {})},
                      role=contract_role, rank=index, test_settings=self._test_settings, root_uri=self.root_uri,
                      node_host=node_host, job_key=self.job_key)
        env["DMLC_ROLE"] = (extra or {}).get("DMLC_ROLE", role)
        if env["DMLC_ROLE"] == "":
            del env["DMLC_ROLE"]
        log = self._log_dir / f"{role}{index}.log" if self._log_dir is not None else None
        cpu = self._cores[len(self.procs) % len(self._cores)] if self._cores else None
        proc = _Proc(role, index, argv, env, log, cpu)
        self.procs.append(proc)
        return proc.popen

    def of(self, role: str, index: int = 0) -> subprocess.Popen:
        """The process started as ``role`` number ``index``."""
        for proc in self.procs:
            if proc.role == role and proc.index == index:
                return proc.popen
        raise KeyError(f"no {role} {index} was started")

    def output_of(self, role: str, index: int = 0) -> str:
        """What the process started as ``role`` number ``index`` printed so far."""
        for proc in self.procs:
            if proc.role == role and proc.index == index:
                return proc.output()
        raise KeyError(f"no {role} {index} was started")

    def wait_for_line(self, role: str, index: int | None, pattern: str, timeout: float = 30) -> "re.Match":
        """Wait until process ``role``/``index`` (any of the role when None) prints a line matching ``pattern``.

        Raises:
            AssertionError: the process exited first, or ``timeout`` seconds passed (with its output).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for result in self.results():
                if result.role == role and index in (None, result.index):
                    match = re.search(pattern, result.output, re.M)
                    if match:
                        return match
                    if result.returncode is not None:
                        raise AssertionError(f"{role} {index} exited before printing {pattern!r}:\n{result}")
            time.sleep(0.05)
        raise AssertionError(f"{role} {index} did not print {pattern!r} within {timeout} s")

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
                running = [p.name for p in self.procs if p.popen.poll() is None]
                self.close()
                details = "\n".join(str(p.result()) for p in self.procs)
                raise TimeoutError(f"still running after {timeout:g} s: {', '.join(running)}\n{details}") from None
        return self.results()

    def wait_ok(self, roles: Sequence[str], timeout: float) -> None:
        """Wait until every process of ``roles`` has exited 0; any process of the job exiting non-zero
        first fails at once (a dead server must not turn into a wait for the whole timeout).

        Raises:
            JobFailed: a process failed (the first one seen) or ``roles`` still ran after ``timeout``
                seconds; the message names it and gives its last lines.
        """
        deadline = time.monotonic() + timeout
        pending = [p for p in self.procs if p.role in roles]
        while True:
            for proc in self.procs:
                code = proc.popen.poll()
                if code is not None and code != 0:
                    raise JobFailed(proc.failure(_describe(code)))
            pending = [p for p in pending if p.popen.poll() is None]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise JobFailed(pending[0].failure(f"still ran after {timeout:g} s (so did {len(pending) - 1} more)"))
            time.sleep(0.05)

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
