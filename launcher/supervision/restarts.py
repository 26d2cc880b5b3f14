"""Restarts: the job's budget (``--max-restarts``, counted for the whole job) and what each attempt did.

With ``--restart-scope job`` a failure stops every process as usual; while restarts are left the
whole job is started again, each process told how many restarts came before
(``PSLAUNCH_RESTART_COUNT``). With ``--restart-scope worker`` a worker that failed on its own is
started again alone, with its rank, while the other processes go on; any other failure is handled
as with ``job``. Either way one budget counts every restart. Only failures of the job's processes
restart it: not ``--timeout`` (it bounds every attempt together) nor a signal to pslaunch.

``RestartLog`` keeps one ``Attempt`` per failure and the end, for the summary (``render``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .verdict import Failure

__all__ = ["Attempt", "RestartLog"]


@dataclass(frozen=True)
class Attempt:
    """One failure of the job (or the end): why, the exit code it would have meant, and what followed."""

    reason: str
    exit_code: int
    action: str


class RestartLog:
    """How many restarts the job may still make, and what happened so far. Not thread-safe."""

    def __init__(self, max_restarts: int, scope: str) -> None:
        self.max_restarts = max_restarts
        self.scope = scope
        self.used = 0
        self.attempts: list[Attempt] = []

    def can_restart(self, failure: Failure | None) -> bool:
        """True when ``failure`` is a process's (not a timeout or signal) and a restart is left."""
        return failure is not None and failure.handle is not None and self.used < self.max_restarts

    def restart(self, failure: Failure, what: str) -> int:
        """Count a restart after ``failure`` (``what`` restarts: "the job", "worker.1@h alone"); returns
        the restart's number, which is the restarted processes' ``PSLAUNCH_RESTART_COUNT``."""
        self.used += 1
        self.attempts.append(Attempt(failure.reason, failure.exit_code,
                                     f"restarted {what} (restart {self.used} of {self.max_restarts})"))
        return self.used

    def finish(self, failure: Failure | None) -> None:
        """Record how the last attempt ended."""
        if failure is None:
            self.attempts.append(Attempt("every worker finished", 0, "none: the job succeeded"))
        elif failure.handle is not None and self.max_restarts:
            self.attempts.append(Attempt(failure.reason, failure.exit_code,
                                         f"gave up: no restart left (--max-restarts {self.max_restarts})"))
        else:
            self.attempts.append(Attempt(failure.reason, failure.exit_code, "stopped: restarts are only for "
                                         "failures of the job's processes" if self.max_restarts else "stopped"))

    def render(self) -> list[str]:
        """The summary's lines, one per attempt: its number, its end, and the next action."""
        return [f"attempt {i}: {a.reason} -> {a.action}" for i, a in enumerate(self.attempts, 1)]
