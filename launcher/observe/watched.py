"""What the views need of a job's processes and of its end, as protocols.

The backends' handles, the supervisor's failure and the restart log's attempts fit them; the views
name only these, so that nothing here imports the parts that start and supervise the processes
(they stand above it and report to it).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["WatchedProcess", "JobEnd", "AttemptRecord", "ReplacementRecord"]


class WatchedProcess(Protocol):
    """A process of the job as pslaunch holds it (``launcher.backends.base.ProcessHandle``)."""

    spec: Any  # its ``launcher.planning.plan.ProcessSpec``
    pid: int | None
    status: Any  # its ``ExitStatus`` once it ended, else None

    @property
    def duration(self) -> float: ...


class JobEnd(Protocol):
    """Why the job failed (``launcher.supervision.verdict.Failure``)."""

    handle: WatchedProcess | None

    @property
    def final_reason(self) -> str: ...


class AttemptRecord(Protocol):
    """One attempt of a job restarted by ``--max-restarts`` (``launcher.supervision.restarts.Attempt``)."""

    reason: str
    exit_code: int
    action: str


class ReplacementRecord(Protocol):
    """A worker replaced in place (``launcher.supervision.replacements.Replacement``)."""

    process: str
    ended_s: float
    resumed_s: float | None

    @property
    def waited_s(self) -> float | None: ...

    def as_dict(self) -> dict[str, Any]: ...
