"""What the batch-scheduler backends (``slurm``, ``sge``) share.

A batch scheduler, not a hostfile, decides where a job runs, and often only once it starts the
job. So these backends plan on a placeholder host until the scheduler has granted the job
(``with_hosts`` then gives the config to plan with: its hosts, the scheduler on the first), start
every process through ``launcher.on_node.rank_shim`` (``launcher.backends.shim``: pid and exit status arrive
as marker lines, requests go to the whole job) under one launcher process (``BatchBackend``), and
run the scheduler's client tools (``run_tool``) with an environment that holds none of the ``--env``
values (``tool_environ``): those reach the job's processes only, never the scheduler.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
from dataclasses import replace
from typing import Callable, Sequence

from ..config import LaunchConfig
from ..errors import ConfigError, SpawnError
from ..on_node.children import child_environ
from ..planning.hostfile import Host
from ..planning.plan import ProcessSpec
from .base import Backend
from .local import LocalHandle, LocalSpawner
from .shim import ShimJob

__all__ = ["BatchBackend", "with_hosts", "split_args", "refuse_host_flags", "refuse_worker_scope", "run_tool",
           "tool_environ", "read_lines", "require_tools", "private_dir", "TOOL_TIMEOUT", "GONE_WAIT"]

#: Seconds a scheduler client command (scontrol, qconf, scancel, ...) may take.
TOOL_TIMEOUT = 30.0
#: Seconds pslaunch waits, at the end, for the scheduler to stop listing a job it cancelled.
GONE_WAIT = 15.0


class BatchBackend(Backend):
    """Base of the slurm and sge backends: one launcher process (``srun``, ``qsub -sync y``) is a
    child of pslaunch while the job runs (``shim.launcher``); every process of the job is a
    ``ShimHandle`` of ``shim``.

    Subclasses set ``shim.launcher`` when they start it, call ``shim.output_done.set()`` once its
    output (or the job's files) is read to the end, and implement ``_deliver`` (called from any
    thread, once per request: ``ShimJob``).
    """

    # the batch scheduler starts the processes on its nodes; pslaunch reaches none of them by ssh
    refuses = {"ssh": "the batch scheduler starts the processes on its nodes; pslaunch does not ssh to them",
               "link_timeout": "the batch scheduler starts the processes on its nodes; pslaunch does not ssh to them",
               "server_replicas": "every process is a task of one batch job, which the batch scheduler may end as a "
                                  "whole when one task is lost",
               "cpu_bind": "the batch scheduler binds its tasks itself: ask it (Slurm: --cpus-per-task and srun's "
                           "--cpu-bind; SGE: qsub -binding)"}

    #: How handles name the launcher process in their details (``srun``, ``the SGE job``).
    launcher_name = "the job"

    def __init__(self, config: LaunchConfig, printer) -> None:
        super().__init__(config, printer)
        self.spawner = LocalSpawner(config.stop_grace)
        self.env = tool_environ(config)
        self.shim = ShimJob(self.launcher_name, self._deliver)
        self._lock = threading.Lock()

    def start_tool(self, argv: list[str], env: dict[str, str]) -> LocalHandle:
        """Start scheduler client ``argv`` as a child of pslaunch (watched by the watchdog), its
        output left to the caller. Raises ``SpawnError``."""
        spec = ProcessSpec(argv[0], 0, Host("localhost"), tuple(argv), {}, on_launcher=True)
        return self.spawner.spawn(spec, self.printer, argv=argv, env=env, readers=False)

    def _deliver(self, verb: str) -> None:
        """Send ``verb`` (one of ``shim.VERBS``) to every process of the job through the scheduler."""
        raise NotImplementedError

    def cancel_and_wait(self, listed: Callable[[], bool], cancel: list[str], what: str) -> None:
        """Until ``listed()`` is False: run ``cancel`` once, then poll, for at most ``GONE_WAIT``
        seconds; a job still listed then is noted, not waited for."""
        deadline = time.monotonic() + GONE_WAIT
        cancelled = False
        while True:
            try:
                if not listed():
                    return
                if not cancelled:
                    run_tool(cancel, self.env)
                    cancelled = True
            except SpawnError as exc:
                self.printer.note(f"could not check that {what} ended: {exc}")
                return
            if time.monotonic() > deadline:
                self.printer.note(f"{what} is still listed {GONE_WAIT:g} s after {shlex.join(cancel)}")
                return
            time.sleep(0.2)


def with_hosts(config: LaunchConfig, hosts: Sequence[Host]) -> LaunchConfig:
    """``config`` with the job's ``hosts`` and the scheduler on the first of them, which every node
    dials by the name the batch scheduler gave it."""
    return replace(config, hosts=tuple(hosts), scheduler_host=hosts[0].name, launch_address=hosts[0].name)


def refuse_host_flags(config: LaunchConfig, backend: str, who: str) -> None:
    """Raise ``ConfigError`` for flags that choose hosts or copy code: ``who`` (the batch
    scheduler) places the job, and its nodes share the file system."""
    if config.hosts:
        raise ConfigError(f"--launcher {backend} runs on the hosts {who} gives the job; drop -H/--hostfile")
    if config.scheduler_host:
        raise ConfigError(f"--launcher {backend} runs the scheduler on the job's first host; drop --scheduler-host "
                          f"{config.scheduler_host}")
    if config.sync_dst_dir:
        raise ConfigError(f"--sync-dst-dir is for the ssh and mpi backends; under {who} the job's hosts share "
                          "pslaunch's directory")


def refuse_worker_scope(config, name: str, label: str) -> None:
    """``--restart-scope worker`` under a batch scheduler: refused (``ConfigError``). Every process is a
    task of the one job pslaunch asked for, holding its slots: a task started again alone would need
    slots of its own, which the scheduler keeps pending while the job runs, and the job's launcher
    (srun, the SGE job) reports for its tasks by index, not for a task added later."""
    if config.restart_scope == "worker":
        raise ConfigError(f"--restart-scope worker cannot be used with --launcher {name}: every process is a task of "
                          f"one {label} job holding its slots, and a task started again alone would wait for slots "
                          "the job holds; use --restart-scope job with --checkpoint-dir")


def split_args(flag: str, text: str | None) -> list[str]:
    """The words of option ``flag``'s ``text`` (shell syntax). Raises ``ConfigError`` naming it."""
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc}") from None


def tool_environ(config: LaunchConfig) -> dict[str, str]:
    """pslaunch's environment for a scheduler client tool: without the ``--env`` variables, so
    that no value meant for the job's processes reaches the scheduler (some store what they get)."""
    secret = {var.name for var in config.env}
    return {k: v for k, v in child_environ({}).items() if k not in secret}


def run_tool(argv: Sequence[str], env: dict[str, str], timeout: float = TOOL_TIMEOUT) -> subprocess.CompletedProcess:
    """Run a scheduler client command, its output captured as text; the caller reads the exit
    code. Raises ``SpawnError`` naming the command when it cannot run or takes over ``timeout``."""
    try:
        return subprocess.run(list(argv), env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=timeout, check=False)
    except FileNotFoundError:
        raise SpawnError(f"no `{argv[0]}` on PATH: {shlex.join(argv)} cannot run") from None
    except OSError as exc:
        raise SpawnError(f"cannot run {shlex.join(argv)}: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired:
        raise SpawnError(f"{shlex.join(argv)} did not answer within {timeout:g} s") from None


def read_lines(pipe, on_line) -> threading.Thread:
    """Start a daemon thread calling ``on_line(text)`` for each line of ``pipe`` until EOF."""

    def run() -> None:
        try:
            for raw in iter(pipe.readline, b""):
                on_line(raw.decode("utf-8", "replace").rstrip("\n"))
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=run, name="pslaunch-tool-reader", daemon=True)
    thread.start()
    return thread


def require_tools(names: Sequence[str], backend: str, package: str) -> None:
    """Raise ``SpawnError`` when one of the scheduler's client commands is not on PATH."""
    import shutil

    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        raise SpawnError(f"--launcher {backend}: no {', '.join(f'`{m}`' for m in missing)} on PATH "
                         f"(install the scheduler's client tools, e.g. apt install {package})")


def private_dir(parent: str | None, prefix: str) -> str:
    """A new directory only this user can enter (mode 0700), in ``parent`` (default: the temp dir)."""
    import tempfile

    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(path, 0o700)
    return path
