"""pslaunch's side of the sge backend: submit, wait for the hosts, hand over the plan, read output.

**Why a parallel-environment job.** An array job's tasks are scheduled one by one: some may start
while others wait for slots, and a job whose scheduler and workers must all run at once could wait
forever half-started. A parallel-environment job gets all its slots at once, SGE chooses the hosts,
and ``qrsh -inherit`` (the PE's ``control_slaves TRUE``) starts processes on them that SGE accounts
to the job and kills with it.

**Submission.** ``qsub -terse -sync y -w e -N pslaunch-ID -pe PE N -cwd -o DIR/job.out -e
DIR/job.err -v PYTHONPATH=... <--sge-args> -b y python -m launcher.on_node.sge_job master DIR``:
one slot per process (one more when the PE's ``job_is_first_task`` is TRUE), refused at once
(``-w e``) when the cluster could never place it. ``qsub -sync y`` runs as a child of pslaunch
until the job ends, and exits with the job's exit code. ``DIR`` is a new directory (mode 0700) in
pslaunch's working directory. Values of ``--env`` are never given to ``qsub`` (``-v`` / ``-V``
values are stored in the qmaster's spool): they travel in ``DIR/plan.json`` (mode 0600), which is
removed when the job ends.

**The job.** Its master task writes the hosts SGE granted; pslaunch plans the job on them (the
scheduler on the first host) and writes the plan; one agent per host starts that host's processes
through ``launcher.on_node.rank_shim`` (``job``). Their stdout and stderr go to files in ``DIR``; pslaunch
polls them and prints them line by line, reading ``rank_shim``'s pid and exit-status markers.

**Signals.** pslaunch appends a request (``TERM``, ``STOP``, ``CONT``, ``END``) to ``DIR/control``;
every agent passes it to its ``rank_shim`` processes as SIGTERM, SIGUSR2, SIGCONT or SIGUSR1, which
they turn into SIGTERM (then SIGKILL after the grace period), SIGSTOP, SIGCONT and SIGUSR1 of their
process groups: stopping, Ctrl-Z and ``fg``, and the end of the bundled nodes. KILL is ``qdel``. At
the end pslaunch deletes the job if it still runs and waits until ``qstat`` no longer lists it;
when pslaunch dies the watchdog runs ``qdel``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import threading
import time

from ..errors import ConfigError, LaunchError, PlacementError, SpawnError
from ..observe.output import LineSplitter
from ..on_node.rank_shim import payload
from ..on_node.sge_job import CONTROL_FILE, HOSTS_FILE, PLAN_FILE
from ..planning.hostfile import Host
from ..planning.plan import Plan, make_plan
from .base import ProcessHandle, route_block
from .batch import (
    GONE_WAIT,
    BatchBackend,
    private_dir,
    read_lines,
    refuse_host_flags,
    refuse_worker_scope,
    require_tools,
    run_tool,
    split_args,
    with_hosts,
)
from .local import _launcher_root
from .shim import ShimHandle

__all__ = ["SgeBackend", "qsub_argv", "parse_pe", "PENDING_HOST", "DEFAULT_PE"]

#: Where the plan puts processes while SGE has not started the job yet (``--dry-run``).
PENDING_HOST = Host("<sge-host>")
DEFAULT_PE = "smp"
_POLL = 0.1
_PENDING_NOTE_AFTER = 3.0


def parse_pe(text: str) -> dict[str, str]:
    """``qconf -sp NAME`` output as ``{attribute: value}``."""
    return {words[0]: words[1] for words in (line.split(None, 1) for line in text.splitlines()) if len(words) == 2}


def qsub_argv(name: str, pe: str, slots: int, jobdir: str, python: str, pythonpath: str,
              user_args: list[str]) -> list[str]:
    """The one ``qsub`` of the job (names and paths only: no ``--env`` value)."""
    return ["qsub", "-terse", "-sync", "y", "-w", "e", "-N", name, "-pe", pe, str(slots), "-cwd",
            "-o", os.path.join(jobdir, "job.out"), "-e", os.path.join(jobdir, "job.err"),
            "-v", f"PYTHONPATH={pythonpath}", *user_args,
            "-b", "y", python, "-m", "launcher.on_node.sge_job", "master", jobdir]


class SgeBackend(BatchBackend):
    """Runs the plan as one SGE parallel-environment job (``--launcher sge``); ``launcher`` is
    ``qsub -sync y``. Not thread-safe, except the methods the handles call (``BatchBackend``)."""

    name = "sge"
    launcher_name = "the SGE job"

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        # qsub -sync y tells the job number only at the end (its stdout is a pipe): pslaunch names
        # the job by its name, which holds pslaunch's random job id, in qstat and qdel.
        self.job = f"pslaunch-{config.job_id}"
        self.submitted = False
        self.number: str | None = None
        self.jobdir: str | None = None
        self.handles: list[ShimHandle] = []
        self._said: list[str] = []
        self._tail: threading.Thread | None = None

    # -- before planning -----------------------------------------------------------------------
    @classmethod
    def configure(cls, config, environ):
        refuse_host_flags(config, "sge", "SGE")
        refuse_worker_scope(config, "sge", "SGE")
        args = split_args("--sge-args", config.sge.args)
        if "-V" in args:
            raise ConfigError("--sge-args -V would store pslaunch's whole environment, --env values included, in the "
                              "qmaster's spool; give the job's processes what they need with --env instead")
        if "-pe" in args:
            raise ConfigError("--sge-args -pe: pslaunch asks for the slots itself (one per process); name the "
                              "parallel environment with --sge-pe")
        return with_hosts(config, [PENDING_HOST])

    @classmethod
    def dry_run_notes(cls, config):
        count = 1 + config.num_servers + config.num_workers
        argv = qsub_argv(f"pslaunch-{config.job_id}", config.sge.pe or DEFAULT_PE, count, "DIR",
                         config.python, "...", split_args("--sge-args", config.sge.args))
        return [f"sge: pslaunch submits {shlex.join(argv)}",
                f"sge: (one slot more when the PE's job_is_first_task is TRUE; DIR is a new directory in {config.cwd})",
                f"sge: then places the processes on the hosts SGE grants as above ({PENDING_HOST.name} stands for "
                "them; the scheduler goes on the first) and starts them with qrsh -inherit, one agent per host"]

    # -- submission ----------------------------------------------------------------------------
    def prepare(self, plan: Plan) -> Plan:
        """Submit the job and wait until SGE starts it (blocks); returns the plan for its hosts.

        Raises ``ConfigError`` for a parallel environment that does not exist or cannot start
        processes with ``qrsh -inherit``, ``PlacementError`` when SGE refuses the job,
        ``SpawnError`` when the job ends before it started the processes, ``LaunchError`` (124)
        past ``--timeout``."""
        require_tools(["qsub", "qdel", "qconf", "qstat"], "sge", "gridengine-client")
        pe = self.config.sge.pe or DEFAULT_PE
        res = run_tool(["qconf", "-sp", pe], self.env)
        attrs = parse_pe(res.stdout)
        if res.returncode != 0 or "control_slaves" not in attrs:
            said = (res.stderr or res.stdout).strip()
            raise ConfigError(f"SGE has no parallel environment {pe!r} (qconf -sp {pe}: {said}); name one with "
                              "--sge-pe (qconf -spl lists them)")
        if attrs["control_slaves"].upper() != "TRUE":
            raise ConfigError(f"SGE parallel environment {pe!r} has control_slaves {attrs['control_slaves']}: pslaunch "
                              "starts the processes with qrsh -inherit, which needs TRUE; choose another with --sge-pe")
        slots = len(plan.processes) + (1 if attrs.get("job_is_first_task", "").upper() == "TRUE" else 0)
        self.jobdir = private_dir(self.config.cwd, ".pslaunch-sge-")
        self.spawner.on_death(["rm", "-rf", "--", self.jobdir])  # it holds the --env values
        argv = qsub_argv(self.job, pe, slots, self.jobdir, self.config.python, _launcher_root(),
                         split_args("--sge-args", self.config.sge.args))
        self.spawner.on_death(["qdel", self.job])
        qsub = self.shim.launcher = self.start_tool(argv, self.env)
        self.submitted = True

        def said(line: str) -> None:
            if line.strip().isdigit():  # -terse: the job number alone (at qsub's end: a pipe buffers it)
                self.number = line.strip()
            elif line.strip():
                self._said.append(line.strip())
                self.shim.last_line = line.strip()

        qsub._threads = [read_lines(qsub.popen.stdout, said), read_lines(qsub.popen.stderr, said)]
        hosts = self._wait_for_hosts(argv)
        plan = make_plan(with_hosts(self.config, hosts))
        self._hand_over(plan)
        return plan

    def _wait_for_hosts(self, argv: list[str]) -> list[Host]:
        qsub = self.shim.launcher
        assert qsub is not None and self.jobdir is not None
        path = os.path.join(self.jobdir, HOSTS_FILE)
        start = time.monotonic()
        noted = False
        while True:
            if os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    granted = json.load(fh)["hosts"]
                return [Host(name, slots=slots) for name, slots in granted]
            if qsub.popen.poll() is not None:
                for thread in qsub._threads:
                    thread.join(5)
                if self.number is None:
                    self.submitted = False
                    raise PlacementError(f"SGE refused the job ({shlex.join(argv)}): "
                                         + ("; ".join(self._said) or f"qsub exited with {qsub.popen.returncode}"))
                tail = "; ".join(_tail(os.path.join(self.jobdir, "job.err")) or self._said)
                raise SpawnError(f"SGE job {self.job} ended before it started the processes "
                                 f"(qsub exited with {qsub.popen.returncode})" + (f": {tail}" if tail else ""))
            now = time.monotonic()
            if not noted and now - start > _PENDING_NOTE_AFTER:
                noted = True
                self.printer.note(f"waiting for SGE to start job {self.job} (qstat -j {self.job} says why it waits)")
            if self.config.timeout is not None and now - start > self.config.timeout:
                raise LaunchError(f"SGE had not started job {self.job} after --timeout {self.config.timeout:g} s",
                                  exit_code=124)
            time.sleep(_POLL)

    def _hand_over(self, plan: Plan) -> None:
        """Write the plan for the job's master task: readable by this user only (it holds secrets)."""
        assert self.jobdir is not None
        content = {"python": self.config.python, "hosts": [spec.host.name for spec in plan.processes],
                   "variables": payload(plan.processes, self.config.stop_grace, os.environ.get("PYTHONPATH", ""))}
        tmp = os.path.join(self.jobdir, PLAN_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(content, fh)
        os.replace(tmp, os.path.join(self.jobdir, PLAN_FILE))

    # -- running -------------------------------------------------------------------------------
    def launch(self, plan: Plan) -> list[ProcessHandle]:
        self.handles = [ShimHandle(spec, self.shim) for spec in plan.processes]
        self.shim.handles = self.handles
        self._tail = threading.Thread(target=self._follow, name="pslaunch-sge-output", daemon=True)
        self._tail.start()
        return list(self.handles)

    def _follow(self) -> None:
        """Print what the job's files gain, until the job has ended and they are read to the end."""
        qsub = self.shim.launcher
        assert self.jobdir is not None and qsub is not None
        readers = []
        for index, handle in enumerate(self.handles):
            for stream in ("out", "err"):
                emit = (lambda block, h=handle, s=f"std{stream}": route_block(h, s, self.printer, block))
                readers.append(_FileTail(os.path.join(self.jobdir, f"{index}.{stream}"), emit))
        for stream in ("out", "err"):
            readers.append(_FileTail(os.path.join(self.jobdir, f"job.{stream}"), self._job_line(f"std{stream}")))
        try:
            while True:
                ended = qsub.popen.poll() is not None
                for reader in readers:
                    reader.read()
                if ended:
                    break
                time.sleep(_POLL)
        finally:
            for reader in readers:
                reader.close()
            self.shim.output_done.set()

    def _job_line(self, stream: str):
        def emit(block: str) -> None:
            said = [text.strip() for text in block.split("\n") if text.strip()]
            if said:
                self.shim.last_line = said[-1]
            self.printer.lines("sge", "sge", block, stream)
        return emit

    # -- signals ---------------------------------------------------------------------------------
    def _deliver(self, verb: str) -> None:
        """KILL is ``qdel``; any other request is a line in ``DIR/control``, which the job's agents
        read and pass to each ``rank_shim`` as a signal (``job``)."""
        if verb == "KILL":
            run_tool(["qdel", self.job], self.env)
        elif self.jobdir is not None:
            fd = os.open(os.path.join(self.jobdir, CONTROL_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, f"{verb}\n".encode())
            finally:
                os.close(fd)

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete the job if it still runs, wait until qstat no longer lists it, remove DIR."""
        try:
            qsub = self.shim.launcher
            if qsub is not None and qsub.popen.poll() is None:
                # Every process ended: the job ends by itself in a moment. Otherwise delete it now.
                if not (self.handles and all(h.status is not None for h in self.handles)):
                    self.shim.kill()
                deadline = time.monotonic() + GONE_WAIT
                while qsub.popen.poll() is None and time.monotonic() < deadline:
                    time.sleep(_POLL)
            if self.submitted:
                self.cancel_and_wait(lambda: run_tool(["qstat", "-j", self.job], self.env).returncode == 0,
                                     ["qdel", self.job], f"SGE job {self.job}")
        finally:
            if self._tail is not None:
                self._tail.join(5)
            if self.shim.launcher is not None:
                self.shim.launcher.close(2.0)
            self.spawner.close()
            if self.jobdir is not None:
                shutil.rmtree(self.jobdir, ignore_errors=True)


class _FileTail:
    """Lines appended to a file another host writes: ``read`` passes the new complete lines on."""

    def __init__(self, path: str, emit) -> None:
        self._path = path
        self._fh = None
        self._splitter = LineSplitter(emit)

    def read(self) -> None:
        """Pass on what the file gained since the last call (nothing while it does not exist)."""
        if self._fh is None:
            try:
                self._fh = open(self._path, "rb")  # noqa: SIM115 - kept open between calls
            except FileNotFoundError:
                return
        while True:
            data = self._fh.read(65536)
            if not data:
                return
            self._splitter.feed(data)

    def close(self) -> None:
        """The file is complete: pass on its last partial line and close it."""
        self.read()
        self._splitter.close()
        if self._fh is not None:
            self._fh.close()


def _tail(path: str, count: int = 3) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return [line.strip() for line in fh.read().splitlines() if line.strip()][-count:]
    except OSError:
        return []
