"""Processes started by ``launcher.on_node.rank_shim`` under one launcher process: mpirun's ranks, the tasks
of a Slurm step, the processes of an SGE job.

pslaunch holds no process of such a job itself, only the launcher process (``mpirun``, ``srun``,
``qsub -sync y``). ``rank_shim`` reports each process's pid and exit status as marker lines that
reach pslaunch through the launcher's output, and signals reach the processes only through the
launcher, all of them at once. So a ``ShimHandle`` learns its status from those markers (failing
them, from the launcher's end) and hands every request to its ``ShimJob``, which sends each
job-wide request once: a stop (TERM), a kill (KILL), Ctrl-Z (STOP) and its end (CONT), and the
end of the bundled nodes (END, once every process still running wrote the READY marker; another
process would die of the SIGUSR1).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..planning.plan import ProcessSpec
from .base import ExitStatus, ProcessHandle
from .local import LocalHandle

__all__ = ["ShimJob", "ShimHandle"]



class ShimJob:
    """The launcher process of a job of ``ShimHandle`` s, and the requests sent through it.

    The backend sets ``launcher`` once it started it, ``handles`` once it made them, appends the
    launcher's own last line to ``last_line`` and sets ``output_done`` once the launcher's output
    (or the job's files) is read to the end. ``deliver(verb)`` (a verb of ``process_groups``) reaches every
    process of the job; it is called outside any lock, only while the launcher runs, and at most
    once per request. Thread-safe.
    """

    def __init__(self, name: str, deliver: Callable[[str], None]) -> None:
        self.name = name  # how details name the launcher: "mpirun", "srun", "the SGE job"
        self.launcher: LocalHandle | None = None
        self.handles: list[ShimHandle] = []
        self.output_done = threading.Event()
        self.last_line = ""  # the launcher's (or the job's) own last line: why it ended, if early
        self._deliver = deliver
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._suspended = False

    def running(self) -> bool:
        """Whether the launcher process runs."""
        return self.launcher is not None and self.launcher.popen.poll() is None

    def ended(self) -> tuple[int, str] | None:
        """``(exit code, last line)`` once the launcher ended and its output is read, else None."""
        if self.launcher is None or self.launcher.popen.poll() is None or not self.output_done.is_set():
            return None
        status = self.launcher.poll()
        assert status is not None
        return status.exit_code, self.last_line

    @property
    def stopping(self) -> bool:
        """Whether pslaunch asked the job to stop (TERM or KILL)."""
        return bool(self._sent & {"TERM", "KILL"})

    def _send(self, verb: str) -> bool:
        with self._lock:
            if verb in self._sent or not self.running():
                return False
            self._sent.add(verb)
        self._deliver(verb)
        return True

    def stop(self) -> None:
        """TERM to every process, once; a job stopped with Ctrl-Z is continued to get it."""
        if self._send("TERM") and self._suspended:
            self.suspend(False)

    def kill(self) -> None:
        """KILL to every process, once."""
        self._send("KILL")

    def suspend(self, stop: bool) -> None:
        """Stop (``stop``) or continue every process; each change is sent once."""
        with self._lock:
            if self._suspended == stop or not self.running():
                return
            self._suspended = stop
        self._deliver("STOP" if stop else "CONT")

    def unless_suspended(self, action: Callable[[LocalHandle], None]) -> None:
        """``action(launcher)`` while the launcher runs, unless the job is stopped (Ctrl-Z): under the
        lock a stop request takes, so a SIGCONT the action sends cannot overtake the stop and end it."""
        with self._lock:
            if self._suspended or not self.running():
                return
            assert self.launcher is not None
            try:
                action(self.launcher)
            except ProcessLookupError:
                pass

    def end(self) -> None:
        """END to every process, once, when every process still running is ready for it."""
        if all(h.ready for h in self.handles if h.poll() is None):
            self._send("END")


class ShimHandle(ProcessHandle):
    """One process of a ``ShimJob``: its pid and exit status come from ``rank_shim``'s marker lines;
    a request to it goes to the whole job (``ShimJob``)."""

    def __init__(self, spec: ProcessSpec, job: ShimJob) -> None:
        super().__init__(spec)
        self._job = job
        self._marked: ExitStatus | None = None

    def on_marker(self, text: str) -> None:
        """``PID n``, ``EXIT n`` or ``SIGNAL n`` from ``launcher.on_node.rank_shim``; the runtime's markers."""
        verb, _, arg = text.strip().partition(" ")
        if verb not in ("PID", "EXIT", "SIGNAL"):
            super().on_marker(text)
            return
        if not arg.isdigit():
            return
        if verb == "PID":
            self.pid = int(arg)
            return
        self.ended = time.monotonic()  # the marker's arrival orders the processes' ends
        self._marked = ExitStatus(code=int(arg)) if verb == "EXIT" else ExitStatus(signal=int(arg))

    def _poll(self) -> ExitStatus | None:
        if self._marked is not None:
            return self._marked
        ended = self._job.ended()
        if ended is None:
            return None
        code, last = ended
        detail = f"no exit status from this process; {self._job.name} ended with {code}"
        return ExitStatus(code=code or 255, detail=f"{detail}: {last}" if last else detail)

    def _tell(self, verb: str) -> None:
        job = self._job  # every request goes to the whole job, once
        if verb == "TERM":
            job.stop()
        elif verb == "KILL":
            job.kill()
        elif verb in ("STOP", "CONT"):
            job.suspend(verb == "STOP")
        else:
            job.end()
