"""Supervision: run a plan through a backend, watch every process, stop everything at the end.

Rules (docs/launcher.md, "Failures"):

* the first process that fails is the root cause: every other process is stopped (SIGTERM, a
  grace period, SIGKILL) and pslaunch exits with that process's exit code (128+signal for a
  signal), after a line naming it (role, rank, host, pid, how it ended) and its last lines;
* a scheduler or server that exits, even with 0, before every worker has finished fails the job
  (exit code 1 when it exited 0; after exit 0 the workers get ``shutdown_grace`` seconds to
  finish too, since the runtime may end a moment before the workers' interpreters do);
* when every worker has exited 0, scheduler and servers get ``shutdown_grace`` seconds to exit by
  themselves (the bundled runtime does), then they are stopped; the job succeeded;
* ``--timeout`` bounds the whole job (exit 124); SIGINT / SIGTERM stop it (exit 130 / 143), a
  second one skips the grace period.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

from .backends.base import Backend, ProcessHandle
from .config import LaunchConfig
from .output import Printer
from .plan import Plan

__all__ = ["Supervisor", "Failure", "EXIT_TIMEOUT"]

#: pslaunch's exit code when ``--timeout`` ran out (as timeout(1)).
EXIT_TIMEOUT = 124
_TICK = 0.05


@dataclass(frozen=True)
class Failure:
    """Why the job failed: a sentence for the root-cause line, the exit code, and the process."""

    reason: str
    exit_code: int
    handle: ProcessHandle | None = None


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Supervisor:
    """Runs one job. ``run`` blocks until the job is over and returns pslaunch's exit code.

    Must be used from the main thread (it installs SIGINT / SIGTERM handlers while running).
    """

    def __init__(self, config: LaunchConfig, backend: Backend, printer: Printer) -> None:
        self.config = config
        self.backend = backend
        self.printer = printer
        self.handles: list[ProcessHandle] = []
        self.failure: Failure | None = None
        self._signals: list[int] = []
        self._raise_on_signal = True
        self._stopped: set[int] = set()

    # -- signals -------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002
        self._signals.append(signum)
        if self._raise_on_signal:
            self._raise_on_signal = False
            raise _Interrupted(signum)

    def _install(self) -> dict[int, object]:
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, self._on_signal)
        return old

    # -- the job -------------------------------------------------------------------------------
    def run(self, plan: Plan) -> int:
        """Prepare, launch and supervise ``plan``; returns the exit code. Raises ``LaunchError``
        from the backend's preparation (pre-flight, rsync) and from starting processes."""
        old = self._install()
        start = time.monotonic()
        try:
            try:
                plan = self.backend.prepare(plan) or plan  # a batch scheduler's hosts are known now
                self.handles = self.backend.launch(plan)
                self._raise_on_signal = False
                if self._signals:
                    raise _Interrupted(self._signals[0])
            except _Interrupted as exc:
                self.failure = Failure(f"pslaunch got {signal.Signals(exc.signum).name}", 128 + exc.signum)
            else:
                self.failure = self._watch(start)
            self._teardown()
        finally:
            try:
                for handle in self.handles:
                    handle.close()
            finally:
                self.backend.close()
                for sig, handler in old.items():
                    signal.signal(sig, handler)  # type: ignore[arg-type]
        self._report()
        return 0 if self.failure is None else self.failure.exit_code

    def _check_signal_or_timeout(self, start: float) -> Failure | None:
        if self._signals:
            sig = self._signals[0]
            return Failure(f"pslaunch got {signal.Signals(sig).name}", 128 + sig)
        if self.config.timeout is not None and time.monotonic() - start > self.config.timeout:
            return Failure(f"the job ran longer than --timeout {self.config.timeout:g} s", EXIT_TIMEOUT)
        return None

    def _watch(self, start: float) -> Failure | None:
        workers = [h for h in self.handles if h.spec.role == "worker"]
        others = [h for h in self.handles if h.spec.role != "worker"]
        seen: set[int] = set()
        shutdown_deadline: float | None = None
        # A scheduler or server that exits 0 while workers still run may just be quicker than the
        # workers' interpreter teardown (the runtime ends once every worker said goodbye): the
        # workers get the shutdown grace period to end too before this counts as a failure.
        early: tuple[ProcessHandle, float] | None = None
        while True:
            failure = self._check_signal_or_timeout(start)
            if failure:
                return failure
            for handle in self.handles:
                status = handle.poll()
                if status is None or id(handle) in seen:
                    continue
                seen.add(id(handle))
                if not status.ok:
                    if early is not None and handle.spec.role == "worker":
                        return self._early_failure(early[0], f"; then {handle.spec.name} failed: {status.describe()}")
                    return Failure(f"{self._who(handle)} failed first: {status.describe()}", status.exit_code, handle)
                if handle.spec.role != "worker" and shutdown_deadline is None and early is None:
                    early = (handle, time.monotonic() + self.config.shutdown_grace)
            if shutdown_deadline is None and all(h.status is not None for h in workers):
                shutdown_deadline = time.monotonic() + self.config.shutdown_grace
                if self.config.verbose:
                    self.printer.note("every worker exited 0; waiting for scheduler and servers to finish")
            elif early is not None and time.monotonic() > early[1]:
                return self._early_failure(early[0], "")
            if shutdown_deadline is not None:
                running = [h for h in others if h.status is None]
                if not running:
                    return None
                if time.monotonic() > shutdown_deadline:
                    if self.config.verbose:
                        self.printer.note(
                            "stopping " + ", ".join(h.spec.name for h in running)
                            + f" after the {self.config.shutdown_grace:g} s shutdown grace period"
                        )
                    return None
            time.sleep(_TICK)

    def _early_failure(self, handle: ProcessHandle, then: str) -> Failure:
        running = [h.spec.name for h in self.handles if h.spec.role == "worker" and h.status is None]
        still = f" ({', '.join(running)} still running)" if running else ""
        return Failure(f"{self._who(handle)} exited with code 0 before the workers finished{still}{then}", 1, handle)

    def _teardown(self) -> None:
        """TERM everything still running, wait the grace period, KILL what is left."""
        running = [h for h in self.handles if h.poll() is None]
        for handle in self.handles:  # exited leaders may leave group members behind
            if handle.status is None:
                self._stopped.add(id(handle))
            handle.terminate()
        deadline = time.monotonic() + self.config.stop_grace
        hurry = len(self._signals)
        while running and time.monotonic() < deadline and len(self._signals) <= hurry:
            time.sleep(_TICK)
            running = [h for h in running if h.poll() is None]
        for handle in self.handles:
            handle.kill()
        deadline = time.monotonic() + max(2.0, self.config.stop_grace)
        while running and time.monotonic() < deadline:
            time.sleep(_TICK)
            running = [h for h in running if h.poll() is None]
        for handle in running:
            self.printer.note(f"{self._who(handle)} did not end after SIGKILL")

    # -- reporting -----------------------------------------------------------------------------
    @staticmethod
    def _who(handle: ProcessHandle) -> str:
        spec = handle.spec
        pid = f", pid {handle.pid}" if handle.pid else ""
        return f"{spec.name} ({spec.role} rank {spec.rank} on {spec.host.label}{pid})"

    def _report(self) -> None:
        if not self.config.quiet and self.handles:
            from .summary import print_summary

            print_summary(self.handles, self._stopped, self.failure, self.printer)
        if self.failure is None:
            return
        self.printer.note(f"root cause: {self.failure.reason}")
        if self.failure.handle is not None:
            lines = self.printer.last_lines(self.failure.handle.spec.name)
            if lines:
                self.printer.note(f"last lines of {self.failure.handle.spec.name}:")
                for text in lines:
                    self.printer.note(f"  | {text}")
            else:
                self.printer.note(f"{self.failure.handle.spec.name} printed nothing")
        self.printer.note(f"exit code {self.failure.exit_code}")


