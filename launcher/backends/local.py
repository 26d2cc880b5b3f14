"""The local backend: every process a child of pslaunch on this machine.

Each process starts in its own session, hence its own process group, so stopping it reaches
everything it started. A watchdog process (``launcher.on_node.watchdog``) holds a pipe to pslaunch and
kills the registered groups when pslaunch dies, even by SIGKILL. ``LocalSpawner`` is shared with
the ssh backend (scheduler on the launching host) and the mpi backend (``mpirun`` itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Sequence

from pscontract import PSLAUNCH_CPU_BIND, binding, hand_key_over, ignore_runtime_signals

from ..errors import SpawnError
from ..on_node.children import READ_SIZE, child_environ, widen_pipe
from ..on_node.process_groups import Group
from ..planning.plan import Plan, ProcessSpec
from .base import Backend, ExitStatus, ProcessHandle, pump
from .checks.checkpoint_dir import check_checkpoint_dir
from .checks.script import check_scripts_here

__all__ = ["LocalBackend", "LocalSpawner", "LocalHandle", "child_environ", "widen_pipe", "READ_SIZE"]

class LocalHandle(ProcessHandle):
    """A child process of pslaunch, leader of its own process group."""

    def __init__(self, spec: ProcessSpec, popen: subprocess.Popen, threads: list[threading.Thread],
                 group: Group | None = None) -> None:
        super().__init__(spec)
        self.popen = popen
        self.pid = popen.pid
        self.group = group or Group.of(popen.pid)  # its group; signals never reach a stranger that took the id
        self._threads = threads

    def _poll(self) -> ExitStatus | None:
        rc = self.popen.poll()
        return None if rc is None else ExitStatus.from_returncode(rc)

    def _tell(self, verb: str) -> None:
        # a stopped or ended group of an ended leader still gets TERM and KILL: its members may linger
        if verb in ("TERM", "KILL") or self.popen.poll() is None:
            self.group.verb(verb)

    def signal_process(self, signum: int) -> bool:
        if self.popen.poll() is not None:
            return False
        try:
            os.kill(self.popen.pid, signum)  # the process alone, not its group
        except OSError:
            return False
        return True

    def close(self, timeout: float = 2.0) -> None:
        for thread in self._threads:
            thread.join(timeout)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


class LocalSpawner:
    """Starts local children in their own process groups under one watchdog. Not thread-safe."""

    def __init__(self, grace: float) -> None:
        self._grace = grace
        self._watchdog: subprocess.Popen | None = None
        self._groups: list[Group] = []
        ignore_runtime_signals()  # the children inherit it: a stack asked before their runtime runs kills none

    def _tell(self, line: str) -> None:
        if self._watchdog is None:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "launcher.on_node.watchdog", str(self._grace)],
                stdin=subprocess.PIPE,
                start_new_session=True,
                env=child_environ({"PYTHONPATH": _launcher_root()}),
            )
        assert self._watchdog.stdin is not None
        self._watchdog.stdin.write(f"{line}\n".encode())
        self._watchdog.stdin.flush()

    def _watch(self, group: Group) -> None:
        self._groups.append(group)
        self._tell(f"add {group.pgid}" + ("" if group.started is None else f" {group.started}"))

    def on_death(self, argv: Sequence[str]) -> None:
        """Have the watchdog run ``argv`` after stopping the groups if pslaunch dies before
        ``close`` (a batch job's ``scancel``). ``close`` forgets it: the backend cleaned up itself."""
        self._tell("run " + json.dumps(list(argv)))

    def spawn(
        self,
        spec: ProcessSpec,
        printer,
        argv: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        handle_cls: type[LocalHandle] = LocalHandle,
        readers: bool = True,
    ) -> LocalHandle:
        """Start ``spec`` (or ``argv``/``env`` in its place) and, if ``readers``, its output readers.

        Raises ``SpawnError`` naming the process and the program when it cannot be executed.
        """
        argv = list(spec.argv if argv is None else argv)
        environ = child_environ(spec.full_env() if env is None else env)
        cpus = _cpus_of(spec, environ)
        key_pipe = hand_key_over(environ)  # the key through a pipe, never in the child's environment
        try:
            popen = subprocess.Popen(
                argv,
                env=environ,
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=() if key_pipe is None else (key_pipe,),
            )
        except OSError as exc:
            raise SpawnError(f"cannot start {spec.name}: {argv[0]!r}: {exc.strerror or exc}") from exc
        finally:
            if key_pipe is not None:
                os.close(key_pipe)
        if cpus is not None:
            try:  # at once: its interpreter starts no thread before it has read its first lines of code
                binding.bind_pid(popen.pid, cpus)
            except OSError:
                pass  # it ended already; its own runtime binds it too (PSLAUNCH_CPU_BIND)
        group = Group.of(popen.pid)  # read now: the child exists until it is reaped
        self._watch(group)
        handle = handle_cls(spec, popen, [], group)
        assert popen.stdout is not None and popen.stderr is not None
        for pipe in (popen.stdout, popen.stderr):
            widen_pipe(pipe.fileno())
        if not readers:
            return handle
        out, err = popen.stdout.fileno(), popen.stderr.fileno()
        handle._threads = [
            pump(lambda: os.read(out, READ_SIZE), handle, "stdout", printer),
            pump(lambda: os.read(err, READ_SIZE), handle, "stderr", printer),
        ]
        return handle

    def close(self) -> None:
        """Kill every group still alive and stop the watchdog (it would do the same on EOF)."""
        for group in self._groups:  # stopped already (the teardown's TERM, grace, KILL): what lingers
            group.signal(signal.SIGKILL)  # not a stranger that took the id of a group long gone
        if self._watchdog is not None:
            try:
                for group in self._groups:
                    self._watchdog.stdin.write(f"del {group.pgid}\n".encode())  # type: ignore[union-attr]
                self._watchdog.stdin.write(b"clear\n")  # type: ignore[union-attr]
                self._watchdog.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                self._watchdog.wait(5)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()
                self._watchdog.wait()
            self._watchdog = None
        self._groups.clear()


def _cpus_of(spec: ProcessSpec, environ: dict[str, str]) -> set[int] | None:
    """``--cpu-bind``: the cores the child gets, out of this machine's cores pslaunch may use; its
    ``PSLAUNCH_CPU_BIND`` becomes that ``list:`` (its runtime binds every thread it has to it).
    Raises ``SpawnError`` naming the process when the value cannot be resolved."""
    value = environ.get(PSLAUNCH_CPU_BIND)
    if not value or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        cpus = binding.resolve(value)
    except ValueError as exc:
        raise SpawnError(f"cannot bind {spec.name} to its cores: {exc}") from None
    environ[PSLAUNCH_CPU_BIND] = "list:" + binding.cpu_list(cpus)
    return cpus


def _launcher_root() -> str:
    """The directory holding the ``launcher`` package, so the watchdog imports this very copy."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    extra = os.environ.get("PYTHONPATH")
    return here + (os.pathsep + extra if extra else "")


class LocalBackend(Backend):
    """Runs every process of the plan on this machine (``--launcher local``)."""

    name = "local"
    refuses = dict.fromkeys(("hostfile", "sync_dst_dir", "ssh", "link_timeout", "scheduler_host"),
                            "the local backend runs every process on this machine, without ssh")

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.spawner = LocalSpawner(config.stop_grace)

    @classmethod
    def check_without_starting(cls, config, plan) -> None:
        check_scripts_here(list(plan.processes), config.cwd)

    def prepare(self, plan: Plan) -> None:
        """Refuse a COMMAND whose script is not there, or a ``--checkpoint-dir`` that cannot be
        written (``ConfigError``), before anything starts."""
        self.check_without_starting(self.config, plan)
        check_checkpoint_dir(plan, self.config.checkpoint_dir, {}, self.config.ssh.connect_timeout)

    def launch(self, plan: Plan) -> list[ProcessHandle]:
        handles: list[ProcessHandle] = []
        try:
            for spec in plan.processes:
                try:
                    handles.append(self.spawner.spawn(spec, self.printer))
                except SpawnError as exc:
                    if spec.argv and spec.argv[0] == self.config.python:  # say which flag to fix
                        raise SpawnError(f"{exc} (the interpreter --python names)") from exc
                    raise
        except Exception:
            for h in handles:
                h.kill()
            raise
        return handles

    def close(self) -> None:
        self.spawner.close()
