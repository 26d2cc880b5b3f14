"""The backend interface: how a planned process is started, watched and stopped somewhere.

A ``Backend`` gets the resolved config and the ``Printer``; ``prepare`` runs its checks (ssh
pre-flight, rsync) or asks a batch scheduler for the job's hosts (and then returns the plan made
for them), and ``launch`` starts every process of a plan, returning one ``ProcessHandle`` per
``ProcessSpec``. Before planning, the class's ``configure`` checks the options only that backend
takes and fills in what it knows (the nodes of a Slurm allocation). The supervisor only talks to handles: ``poll`` for an
``ExitStatus``, ``terminate`` (SIGTERM to the process's group), ``kill`` (SIGKILL), ``close``.
Output is read by the backend's own threads and goes to the printer line by line.
"""

from __future__ import annotations

import signal
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping

from ..config import LaunchConfig
from ..output import LineSplitter, Printer
from ..plan import Plan, ProcessSpec

__all__ = ["Backend", "ProcessHandle", "ExitStatus", "pump", "drain", "route_line", "MARKER"]

#: Start of a control line that remote guards and ``launcher.mpi_rank`` write on stderr.
MARKER = "\x1fPSLAUNCH-"


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: an exit ``code``, or the ``signal`` that killed it."""

    code: int | None = None
    signal: int | None = None
    detail: str | None = None

    @classmethod
    def from_returncode(cls, returncode: int) -> "ExitStatus":
        """From ``Popen.returncode`` (negative for a signal)."""
        return cls(signal=-returncode) if returncode < 0 else cls(code=returncode)

    @property
    def exit_code(self) -> int:
        """The shell convention: the code, or 128 + the signal number."""
        return 128 + self.signal if self.signal is not None else int(self.code or 0)

    @property
    def ok(self) -> bool:
        """True for exit code 0."""
        return self.signal is None and self.code == 0

    def describe(self) -> str:
        """``exit code 3``, ``signal SIGKILL``, ``exit code 137 (128+SIGKILL)``, plus any detail."""
        if self.signal is not None:
            text = f"signal {_signame(self.signal)}"
        elif self.code is not None and 128 < self.code < 128 + 65:
            text = f"exit code {self.code} (128+{_signame(self.code - 128)})"
        else:
            text = f"exit code {self.code}"
        return f"{text} ({self.detail})" if self.detail else text


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


class ProcessHandle(ABC):
    """A started process of the job. Methods never block longer than a network round trip."""

    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self.status: ExitStatus | None = None

    def poll(self) -> ExitStatus | None:
        """The exit status once the process ended, else None. Non-blocking."""
        if self.status is None:
            status = self._poll()
            if status is not None:
                self.status = status
                self.ended = time.monotonic()
        return self.status

    @abstractmethod
    def _poll(self) -> ExitStatus | None: ...

    @abstractmethod
    def terminate(self) -> None:
        """Ask the process and everything in its process group to stop (SIGTERM). Non-blocking."""

    @abstractmethod
    def kill(self) -> None:
        """Kill the process and its process group (SIGKILL). Non-blocking."""

    def close(self, timeout: float = 2.0) -> None:
        """Release pipes, channels and reader threads (waiting up to ``timeout`` for late output)."""

    @property
    def duration(self) -> float:
        """Seconds from start to end (or to now while running)."""
        return (self.ended or time.monotonic()) - self.started


class Backend(ABC):
    """Starts the processes of a plan on some kind of machines. Not thread-safe."""

    #: The name ``--launcher`` selects it by.
    name = "base"
    #: Names of the ``LaunchConfig.backend_options`` this backend takes; any other one is refused.
    options: tuple[str, ...] = ()

    def __init__(self, config: LaunchConfig, printer: Printer) -> None:
        self.config = config
        self.printer = printer

    @classmethod
    def configure(cls, config: LaunchConfig, environ: Mapping[str, str]) -> LaunchConfig:
        """Check this backend's options against ``config`` and return the config to plan with
        (hosts, scheduler host) before planning. Runs for ``--dry-run`` too, so it starts nothing
        that outlives it. Raises ``ConfigError``. The default returns ``config`` unchanged."""
        return config

    @classmethod
    def dry_run_notes(cls, config: LaunchConfig) -> list[str]:
        """Lines ``--dry-run`` prints after the plan: what the backend will ask of others
        (a batch scheduler's command line, say). The default has none."""
        return []

    def prepare(self, plan: Plan) -> Plan | None:
        """Check and set up everything before the first process starts (pre-flight, rsync, a
        batch scheduler's allocation). Returns the plan to launch instead of ``plan`` when the
        hosts were only known now, else None.

        Raises ``PreflightError`` / ``SyncError`` / ``PlacementError``. The default does nothing.
        """
        return None

    @abstractmethod
    def launch(self, plan: Plan) -> list[ProcessHandle]:
        """Start every process of ``plan``; returns handles in plan order. Raises ``SpawnError``.

        On error the processes already started are stopped before raising.
        """

    def close(self) -> None:
        """Release everything the backend holds (connections, the watchdog). Idempotent."""


def drain(read: Callable[[], bytes], feed: Callable[[bytes], None]) -> None:
    """Pass each chunk ``read()`` returns to ``feed`` until it returns b"" or fails (the stream closed)."""
    while True:
        try:
            data = read()
        except (OSError, EOFError, ValueError):
            return
        if not data:
            return
        feed(data)


def route_line(handle: ProcessHandle, stream: str, printer: Printer, text: str,
               on_marker: Callable[[str], None] | None = None) -> None:
    """Print one line of ``handle``'s output; a line holding ``MARKER`` is a control line: the
    text after the marker goes to ``on_marker`` and the text before it (a partial line) is printed."""
    spec = handle.spec
    if MARKER in text:
        before, _, control = text.partition(MARKER)
        if before:
            printer.line(spec.name, spec.role, before, stream)
        if on_marker is not None:
            on_marker(control)
        return
    printer.line(spec.name, spec.role, text, stream)


def pump(
    read: Callable[[], bytes],
    handle: ProcessHandle,
    stream: str,
    printer: Printer,
    on_marker: Callable[[str], None] | None = None,
) -> threading.Thread:
    """Start a daemon thread that reads ``read()`` until it returns b"" and prints the lines.

    Lines holding ``MARKER`` are control lines: the text after the marker goes to
    ``on_marker`` and the text before it (a partial line of output) is printed.
    """
    spec = handle.spec

    def run() -> None:
        splitter = LineSplitter(lambda text: route_line(handle, stream, printer, text, on_marker))
        try:
            drain(read, splitter.feed)
        finally:
            splitter.close()

    thread = threading.Thread(target=run, name=f"pslaunch-{stream}-{spec.name}", daemon=True)
    thread.start()
    return thread
