"""Restarts: the job's budget (``--max-restarts``, counted for the whole job) and what each attempt did.

With ``--restart-scope job`` a failure stops every process as usual; while restarts are left the
whole job is started again, each process told how many restarts came before
(``PSLAUNCH_RESTART_COUNT``). With ``--restart-scope worker`` a worker that failed on its own is
started again alone, with its rank, while the other processes go on; any other failure is handled
as with ``job``, but only with ``--checkpoint-dir`` (or ``--allow-restart-from-scratch``): a job
that lost a server and has no checkpoint would begin the training again. One budget counts every
restart. Only failures of the job's processes
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

    def __init__(self, max_restarts: int, scope: str, whole_job: bool = True) -> None:
        self.max_restarts = max_restarts
        self.scope = scope
        self.whole_job = whole_job  # the job may be started again as a whole (a checkpoint, or from scratch allowed)
        self.used = 0
        self.attempts: list[Attempt] = []

    def can_restart(self, failure: Failure | None) -> bool:
        """True when the job may be started again after ``failure``: a process's (not a timeout or
        signal), a restart is left, and whole-job restarts are allowed."""
        return (failure is not None and failure.handle is not None and self.used < self.max_restarts
                and self.whole_job)

    def held_back(self, failure: Failure | None) -> str | None:
        """Why the job is not started again after ``failure`` although restarts are left: whole-job
        restarts need a checkpoint (``--restart-scope worker`` without ``--checkpoint-dir``); else None."""
        if failure is None or failure.handle is None or self.whole_job or self.used >= self.max_restarts:
            return None
        return (f"{failure.reason}: without --checkpoint-dir only a failed worker is restarted (alone, "
                "--restart-scope worker); the job is not started again, which would begin the training anew "
                "(give --checkpoint-dir DIR to survive a server's failure too)")

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
        elif failure.handle is not None and self.max_restarts and not self.whole_job:
            self.attempts.append(Attempt(failure.reason, failure.exit_code, "stopped: without --checkpoint-dir only a "
                                         "failed worker is restarted (alone); the job is not started again"))
        elif failure.handle is not None and self.max_restarts:
            self.attempts.append(Attempt(failure.reason, failure.exit_code,
                                         f"gave up: no restart left (--max-restarts {self.max_restarts})"))
        else:
            self.attempts.append(Attempt(failure.reason, failure.exit_code, "stopped: restarts are only for "
                                         "failures of the job's processes" if self.max_restarts else "stopped"))

    def render(self) -> list[str]:
        """The summary's lines, one per attempt: its number, its end, and the next action."""
        return [f"attempt {i}: {a.reason} -> {a.action}" for i, a in enumerate(self.attempts, 1)]
