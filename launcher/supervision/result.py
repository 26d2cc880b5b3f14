"""How a job ended, as data: ``RunResult`` (what ``launcher.launch`` returns), a row per process
(``ProcessOutcome``) and the root cause (``RootCause``); ``result_of`` builds it from the handles the
supervisor (or a per-node agent) watched. A module of its own, below the supervisor and the agents
that fill it in and the API that returns it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .replacements import Replacement
from .restarts import Attempt

if TYPE_CHECKING:
    from ..backends.base import ProcessHandle
    from .verdict import Failure

__all__ = ["RunResult", "ProcessOutcome", "RootCause", "result_of"]


@dataclass(frozen=True)
class ProcessOutcome:
    """One row of the summary table: how one process of the last attempt ended."""

    name: str  # worker.1@host
    role: str
    rank: int
    host: str
    pid: int | None
    exit_code: int | None  # None while running (never at the end) or when killed by a signal
    signal: int | None  # the signal that ended it, else None
    duration_s: float
    note: str  # the table's note: root cause, ended: a peer failed, stopped by pslaunch, ...


@dataclass(frozen=True)
class RootCause:
    """The first real failure: the sentence pslaunch prints, and the process with its last lines."""

    reason: str
    exit_code: int
    process: str | None  # None when no process is to blame (a timeout, Ctrl-C, a lost host)
    role: str | None
    rank: int | None
    host: str | None
    pid: int | None
    last_lines: tuple[str, ...]

    @property
    def error_line(self) -> str | None:
        """The line of the process's last lines that names the exception it died of (``ValueError:
        ...``, the last such line of a Python traceback), or None."""
        for line in reversed(self.last_lines):
            if _EXCEPTION_LINE.match(line.strip()):
                return line.strip()
        return None


#: The last line of a Python traceback: the exception's (dotted) class name, then its message.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|Failed|Warning)\b(: .*)?$")


@dataclass(frozen=True)
class RunResult:
    """How a job ended: pslaunch's exit code, the root cause, a row per process and the attempts."""

    exit_code: int
    root_cause: RootCause | None
    processes: tuple[ProcessOutcome, ...]
    attempts: tuple[Attempt, ...]  # with --max-restarts: each failure and what followed
    plan: str | None = None  # ``launch(dry_run=True)``: the plan --dry-run prints (nothing ran)
    replacements: tuple[Replacement, ...] = ()  # --restart-scope worker: each worker replaced in place

    @property
    def ok(self) -> bool:
        """True when every worker finished and nothing failed."""
        return self.exit_code == 0

    def check(self) -> "RunResult":
        """This result when the job succeeded; else raise ``JobFailed`` naming the root cause (its
        ``result`` attribute holds this result, its ``exit_code`` the job's)."""
        if self.ok:
            return self
        from ..errors import JobFailed

        cause = self.root_cause
        where = f" ({cause.process})" if cause is not None and cause.process else ""
        raised = f": {cause.error_line}" if cause is not None and cause.error_line else ""
        error = JobFailed(f"the job failed with exit code {self.exit_code}: "
                          f"{cause.reason if cause is not None else 'no root cause'}{where}{raised}", self.exit_code)
        error.result = self
        raise error

    def process(self, name: str) -> ProcessOutcome:
        """The row of process ``name`` (``worker.1`` or ``worker.1@host``). Raises KeyError."""
        for outcome in self.processes:
            if name in (outcome.name, outcome.name.split("@", 1)[0]):
                return outcome
        raise KeyError(f"no process {name!r} in this job; it has {', '.join(p.name for p in self.processes)}")


def result_of(handles: "Sequence[ProcessHandle]", table_notes: dict[int, str], failure: "Failure | None",
              last_lines, attempts: Sequence[Attempt], replacements: Sequence[Replacement] = ()) -> RunResult:
    """The ``RunResult`` of a supervised job: its ``handles`` (in table order), the table's notes by
    handle id, the root cause, ``last_lines(name)`` of the printer, the attempts and the replacements."""
    rows = []
    for handle in handles:
        status = handle.status
        rows.append(ProcessOutcome(
            name=handle.spec.name, role=handle.spec.role, rank=handle.spec.rank, host=handle.spec.host.label,
            pid=handle.pid, exit_code=None if status is None or status.signal is not None else status.exit_code,
            signal=None if status is None else status.signal, duration_s=round(handle.duration, 3),
            note=table_notes.get(id(handle), "")))
    root = None
    if failure is not None:
        culprit = failure.handle
        root = RootCause(
            reason=failure.final_reason, exit_code=failure.exit_code,
            process=None if culprit is None else culprit.spec.name,
            role=None if culprit is None else culprit.spec.role,
            rank=None if culprit is None else culprit.spec.rank,
            host=None if culprit is None else culprit.spec.host.label,
            pid=None if culprit is None else culprit.pid,
            last_lines=() if culprit is None else failure.quoted or tuple(last_lines(culprit.spec.name)))
    return RunResult(0 if failure is None else failure.exit_code, root, tuple(rows), tuple(attempts),
                     replacements=tuple(replacements))
