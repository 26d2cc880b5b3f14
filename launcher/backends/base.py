"""The backend interface: how a planned process is started, watched and stopped somewhere.

A ``Backend`` gets the resolved config and the ``Printer``; ``prepare`` runs its checks (ssh
pre-flight, rsync, the script's presence) or asks a batch scheduler for the job's hosts (and then
returns the plan made for them), and ``launch`` starts every process of a plan, returning one
``ProcessHandle`` per ``ProcessSpec``. Before planning, the class's ``configure`` checks the
options only that backend takes and fills in what it knows (the nodes of a Slurm allocation). The
supervisor only talks to handles: ``poll`` for an ``ExitStatus``, the five verbs of
``launcher.on_node.process_groups`` (``terminate``: SIGTERM and SIGCONT to the process's group,
``kill``, ``suspend`` / ``resume`` for Ctrl-Z, ``request_end``: SIGUSR1 to a bundled node), each
backend's handle carrying them its way (``_tell``), and ``close``. A handle whose host is lost
(``_lost``) ends with exit 255 and takes no verb. Output is read by the backend's own threads
and goes to the printer in blocks of lines; marker lines (``MARKER``...) from wrappers and the
runtime go to the handle instead.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping

from pscontract import MARKER, SETTINGS, stack_signal

from ..config import LaunchConfig
from ..observe.output import LineSplitter, Printer
from ..on_node.process_groups import VERBS
from ..planning.network import resolve
from ..planning.plan import THREAD_VARIABLES, Plan, ProcessSpec, make_plan

if TYPE_CHECKING:
    from ..planning.capacity import Capacity

__all__ = ["Backend", "ProcessHandle", "GuardedHandle", "ExitStatus", "Interruption", "pump", "drain", "route_block", "MARKER"]


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: an exit ``code``, or the ``signal`` that killed it; or, ``lost``, that
    pslaunch lost its host (``detail`` says how) and cannot know (``code`` is then 255, as ssh's)."""

    code: int | None = None
    signal: int | None = None
    detail: str | None = None
    lost: bool = False

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
        """``exit code 3``, ``signal SIGKILL``, ``exit code 137 (128+SIGKILL)``, plus any detail;
        ``host lost (no answer for 15 s)``."""
        if self.lost:
            return f"host lost ({self.detail})"
        if self.signal is not None:
            text = f"signal {_signame(self.signal)}"
        elif self.code is not None and 128 < self.code < 128 + 65:
            text = f"exit code {self.code} (128+{_signame(self.code - 128)})"
        else:
            text = f"exit code {self.code}"
        return f"{text} ({self.detail})" if self.detail else text


@dataclass(frozen=True)
class Interruption:
    """Why a backend ends the job from outside pslaunch (a per-node agent's Ctrl-C): the sentence of
    the root cause and the exit code."""

    reason: str
    exit_code: int


#: The signals that end a process from outside (a person, a preemption, the OOM killer's SIGKILL).
_ENDED_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


_STALLS_KEPT = 20  # stall reports a handle keeps, the newest


def _stall_text(text: str) -> tuple[str, tuple[int, ...], bool] | None:
    """``server 1: stalled: ...``, the worker ranks it waits for and whether it is fatal (past
    ``--stall-timeout``), from a ``STALL`` marker's JSON (``{"node", "text", "workers", "fatal"}``);
    None when it does not parse (the process's own output may imitate a marker: it only loses the
    report)."""
    try:
        body = json.loads(text[:1 << 14])
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("node"), str) or not isinstance(body.get("text"), str):
        return None
    workers = body.get("workers")
    ranks = tuple(w for w in workers[:64] if type(w) is int and 0 <= w < 1 << 20) if isinstance(workers, list) else ()
    return f"{body['node'][:40]}: {body['text'][:1000]}", ranks, body.get("fatal") is True


def _preempted(text: str) -> dict:
    """A ``PREEMPTED`` marker's JSON (``{"checkpoint": id, "scalars"}``); ``{}`` when it does not parse
    (the process's own output may imitate a marker: it only loses the checkpoint's id)."""
    try:
        body = json.loads(text[:1 << 17])
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _resumed_scalars(text: str) -> dict | None:
    """The scalars of a ``RESUMED`` marker's JSON (``{"mark", "scalars"}``); None when it names none or
    does not parse (the process's own output may imitate a marker: it only loses the scalars)."""
    try:
        body = json.loads(text[:1 << 17])
    except ValueError:
        return None
    scalars = body.get("scalars") if isinstance(body, dict) else None
    return scalars if isinstance(scalars, dict) else None


class ProcessHandle(ABC):
    """A started process of the job. Methods never block longer than a network round trip.

    Besides its exit status a handle learns from marker lines (``on_marker``): ``ready`` (a
    bundled node that ends normally on ``request_end``), ``failed_at`` (the process reported its
    own uncaught error, the time pslaunch read that), and of a worker replaced in place
    ``resumed_at`` / ``resumed_from`` (it found its predecessor's last mark, and its scalars) and
    ``caught_up_at`` (its first push its predecessor had not sent: ``launcher.supervision.replacements``).
    ``unreachable``: pslaunch lost the process's host, so its status is ``lost`` and signals cannot
    reach it.
    """

    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self.status: ExitStatus | None = None
        self.ready = False
        self.failed_at: float | None = None
        self.resumed_at: float | None = None
        self.resumed_from: dict | None = None
        self.caught_up_at: float | None = None
        self.finished_at: float | None = None
        self.left_at: float | None = None  # an elastic job's worker left it at a step boundary (``LEFT``)
        self.joined_at: float | None = None  # a worker joined the running elastic job (``JOINED``)
        self.preempted: dict | None = None  # worker 0 committed a checkpoint as the job was preempted
        # (when, "server 1: stalled: ...", the worker ranks it waits for): its STALL markers, the newest last
        self.stalls: list[tuple[float, str, tuple[int, ...]]] = []
        self.fatal_stall: tuple[float, str, tuple[int, ...]] | None = None  # the first past --stall-timeout
        self.unreachable = False
        self._threads: list[threading.Thread] = []  # the readers of its output, where pslaunch reads it
        self._settled = False

    def poll(self) -> ExitStatus | None:
        """The exit status once the process ended, else None. Non-blocking."""
        if self.status is None:
            status = self._poll()
            if status is not None:
                self.status = status
                self.ended = self.ended or time.monotonic()
        return self.status

    def on_marker(self, text: str) -> None:
        """A control line the process (or its wrapper) wrote; ``text`` is what follows ``MARKER``."""
        verb, _, rest = text.strip().partition(" ")
        if verb == "READY":
            self.ready = True
        elif verb == "FAILED" and self.failed_at is None:
            self.failed_at = time.monotonic()
        elif verb == "RESUMED" and self.resumed_at is None:
            self.resumed_from = _resumed_scalars(rest)
            self.resumed_at = time.monotonic()
        elif verb == "CAUGHT-UP" and self.caught_up_at is None:
            self.caught_up_at = time.monotonic()
        elif verb == "FINISHED" and self.finished_at is None:
            self.finished_at = time.monotonic()
        elif verb == "LEFT" and self.left_at is None:
            self.left_at = time.monotonic()
        elif verb == "JOINED" and self.joined_at is None:
            self.joined_at = time.monotonic()
        elif verb == "PREEMPTED" and self.preempted is None:
            self.preempted = _preempted(rest)
        elif verb == "STALL":
            said = _stall_text(rest)
            if said is not None:
                text, ranks, fatal = said
                self.stalls = [*self.stalls[-(_STALLS_KEPT - 1):], (time.monotonic(), text, ranks)]
                if fatal and self.fatal_stall is None:
                    self.fatal_stall = self.stalls[-1]

    def settle_output(self, timeout: float = 0.5) -> None:
        """Wait up to ``timeout`` for the readers of an ended process's output to reach its end, so
        that its last marker lines (``FINISHED``) are in before pslaunch judges how it ended."""
        if self._settled:
            return
        self._settled = True  # once: readers held open by a leftover child must not cost every call
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def ended_after_its_part(self) -> bool:
        """A worker ended from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP) after the scheduler took its
        finish: the training's rounds had all its pushes and pulls, so nothing waits for a
        replacement. Its own error, or a crash (SIGSEGV, SIGABRT), is still a failure."""
        status = self.status
        if self.finished_at is None or self.failed_at is not None or status is None:
            return False
        # a remote guard reports a signal the shell's way, as 128 + its number
        number = status.signal if status.signal is not None else (status.code or 0) - 128
        return number in _ENDED_FROM_OUTSIDE

    def dump_stack(self) -> bool:
        """Ask the process for every thread's Python stack, which it writes to its stderr (a worker of
        the bundled runtime: ``pscontract.stack_signal``); False when this backend cannot carry that."""
        return self.signal_process(stack_signal())

    def signal_process(self, signum: int) -> bool:
        """Send signal number ``signum`` to the process alone, not its group (the runtime's own signals:
        ``stack_signal``, ``preempt_signal``); False when it ended or this backend cannot carry one."""
        return False

    def in_doubt(self) -> bool:
        """Whether the process is running on a host pslaunch has not heard from for a while (it may
        be lost: the supervisor waits for that verdict before it names a root cause). Non-blocking."""
        return False

    @abstractmethod
    def _poll(self) -> ExitStatus | None: ...

    def _lost(self, detail: str, last_heard: float | None = None) -> ExitStatus:
        """The status of a process whose host pslaunch lost (``detail`` says how): exit 255, as ssh's;
        no signal reaches it any more. ``last_heard``: the host's last sign of life, which orders the
        failures (default: now)."""
        self.unreachable = True
        if last_heard is not None:
            self.ended = last_heard
        return ExitStatus(code=255, detail=detail, lost=True)

    # ---- the five verbs (``launcher.on_node.process_groups``) ------------------------------------
    def tell(self, verb: str) -> None:
        """Do ``verb`` (``TERM``, ``KILL``, ``STOP``, ``CONT`` or ``END``) to the process and its process
        group, wherever it runs; nothing once its host is lost. Non-blocking.

        Raises:
            ValueError: not one of the verbs.
        """
        if verb not in VERBS:
            raise ValueError(f"unknown verb {verb!r}; the verbs are {', '.join(VERBS)}")
        if not self.unreachable:
            self._tell(verb)

    def _tell(self, verb: str) -> None:
        """Carry ``verb`` to the process: a signal to its group here, a line to its guard, a frame to
        its node's agent, a request to its launcher. Every backend's handle says how."""
        raise NotImplementedError(f"{type(self).__name__} cannot carry {verb}: it defines no _tell")

    def terminate(self) -> None:
        """Ask the process and its group to stop: SIGTERM, then SIGCONT so that a stopped group gets it."""
        self.tell("TERM")

    def kill(self) -> None:
        """Kill the process and its process group (SIGKILL)."""
        self.tell("KILL")

    def suspend(self) -> None:
        """Stop the process group (SIGSTOP), for Ctrl-Z of pslaunch."""
        self.tell("STOP")

    def resume(self) -> None:
        """Continue a suspended process group (SIGCONT)."""
        self.tell("CONT")

    def request_end(self) -> None:
        """Ask a ``ready`` bundled node to end normally (SIGUSR1): the job is over."""
        self.tell("END")

    def close(self, timeout: float = 2.0) -> None:
        """Release pipes, channels and reader threads (waiting up to ``timeout`` for late output)."""

    @property
    def duration(self) -> float:
        """Seconds from start to end (or to now while running)."""
        return (self.ended or time.monotonic()) - self.started


class GuardedHandle(ProcessHandle):
    """A process started under the remote guard (``launcher.backends.checks``), which reports the
    process's pid as a ``PID n`` marker line."""

    def on_marker(self, text: str) -> None:
        """Control lines: ``PID n`` from the guard, the runtime's (``ProcessHandle.on_marker``)."""
        verb, _, arg = text.strip().partition(" ")
        if verb == "PID" and arg.isdigit():
            self.pid = int(arg)
        else:
            super().on_marker(text)


class Backend(ABC):
    """Starts the processes of a plan on some kind of machines. Not thread-safe."""

    #: The name ``--launcher`` selects it by.
    name = "base"
    #: Options this backend has no use for, with why, by option name (``launcher.options``) or
    #: option group (``ssh``: each of its options): given, each is refused before anything starts
    #: (``--dry-run`` too) instead of being ignored. The ``slurm``, ``sge``, ``ray`` and ``agents``
    #: groups are refused to every backend but the one of that name without being listed.
    refuses: Mapping[str, str] = {}

    def __init__(self, config: LaunchConfig, printer: Printer) -> None:
        self.config = config
        self.printer = printer

    @classmethod
    def planned(cls, config: LaunchConfig, environ: Mapping[str, str]) -> tuple[LaunchConfig, Plan]:
        """What every launch does before anything starts, ``--dry-run`` included: resolve the
        addresses and ports (``resolve``), fill in what the backend knows (``configure``) and plan
        (``make_plan``). Raises ``LaunchError``."""
        config = cls.configure(cls.resolve(config), environ)
        if set(environ) & set(THREAD_VARIABLES):  # the user chose the thread count: pslaunch sets none
            config = replace(config, threads_chosen=True)
        given = {v.name for v in config.env}
        left = tuple(name for name in SETTINGS if name in environ and name not in given)
        if left:
            config = replace(config, settings_left=left)
        return config, cls.make_plan(config)

    @classmethod
    def resolve(cls, config: LaunchConfig) -> LaunchConfig:
        """The scheduler's address and ports, from a look at this machine
        (``launcher.planning.network.resolve``, with the hosts' names as given). A backend whose
        hosts have other names (ssh config), or that learns the addresses where the processes run
        (Ray, the per-node agents), says so here."""
        return resolve(config)

    @classmethod
    def make_plan(cls, config: LaunchConfig) -> Plan:
        """The plan of ``config`` (``launcher.planning.plan.make_plan``). Pure."""
        return make_plan(config)

    @classmethod
    def configure(cls, config: LaunchConfig, environ: Mapping[str, str]) -> LaunchConfig:
        """Check this backend's options against ``config`` and return the config to plan with
        (hosts, scheduler host) before planning. Runs for ``--dry-run`` too, so it starts nothing
        that outlives it. Raises ``ConfigError``. The default returns ``config`` unchanged."""
        return config

    @classmethod
    def check_without_starting(cls, config: LaunchConfig, plan: Plan) -> None:
        """The checks of ``prepare`` that read and start nothing (``--dry-run`` makes them too).
        Raises ``ConfigError``. The default has none."""

    @classmethod
    def dry_run_plan(cls, config: LaunchConfig, plan: Plan) -> Plan:
        """The part of ``plan`` ``--dry-run`` shows: what this pslaunch starts (a per-node agent's
        share). The default is the whole plan."""
        return plan

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

    def capacity(self) -> "Capacity | None":
        """Where an elastic job's capacity comes from when the backend knows it (the agents that are
        joined), else None: the supervisor reads the hostfile or discovery script then. Default None."""
        return None

    def prepare_more(self, plan: Plan) -> None:
        """Check and set up the hosts of ``plan`` that ``prepare`` did not (a worker joining an elastic
        job on a new host: pre-flight, rsync). Raises as ``prepare``. The default does nothing."""

    @abstractmethod
    def launch(self, plan: Plan) -> list[ProcessHandle]:
        """Start every process of ``plan``; returns handles in plan order. Raises ``SpawnError``.

        On error the processes already started are stopped before raising.
        """

    def interruption(self) -> Interruption | None:
        """An ``Interruption`` that ends the job from outside this process (a per-node
        agent's Ctrl-C), else None. Non-blocking; the supervisor asks at every turn. Default None."""
        return None

    def job_ended(self, exit_code: int, reason: str | None) -> None:
        """The job is over with ``exit_code`` (0: it succeeded) for ``reason`` (the root cause, or
        why it could not start); called once before ``close``, after every process ended. The
        default does nothing."""

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


def route_block(handle: ProcessHandle, stream: str, printer: Printer, block: str) -> None:
    """Print a block of ``handle``'s lines; marker lines go to ``handle.on_marker`` instead, or to the
    printer's observer when they are its (the text before a marker on its line, a partial line of
    output, is printed)."""
    spec = handle.spec
    if MARKER not in block:
        printer.lines(spec.name, spec.role, block, stream)
        return
    plain: list[str] = []
    for text in block.split("\n"):
        if MARKER not in text:
            plain.append(text)
            continue
        before, _, control = text.partition(MARKER)
        if before:
            plain.append(before)
        if plain:
            printer.lines(spec.name, spec.role, "\n".join(plain), stream)
            plain = []
        observer = printer.observer
        if observer is None or not observer(handle, control):
            handle.on_marker(control)
    if plain:
        printer.lines(spec.name, spec.role, "\n".join(plain), stream)


def pump(read: Callable[[], bytes], handle: ProcessHandle, stream: str, printer: Printer) -> threading.Thread:
    """Start a daemon thread that reads ``read()`` until it returns b"" and prints the lines
    (``route_block``)."""

    def run() -> None:
        splitter = LineSplitter(lambda block: route_block(handle, stream, printer, block))
        try:
            drain(read, splitter.feed)
        finally:
            splitter.close()

    thread = threading.Thread(target=run, name=f"pslaunch-{stream}-{handle.spec.name}", daemon=True)
    thread.start()
    return thread
