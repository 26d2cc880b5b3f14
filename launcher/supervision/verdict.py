"""Why a job ended: how each process ended, and which one is the root cause.

Every process that ended falls into one kind (``kind_of``):

* ``own``: it failed on its own — a non-zero exit other than 75, a signal nobody sent it, or it
  reported its own uncaught error (the runtime's ``PSLAUNCH-FAILED`` marker, written right after
  its traceback, also when it was stopped before it could exit); or pslaunch lost its host
  (``unreachable``: the host is then the root cause, at the time it was last heard from);
* ``peer``: it exited with ``EXIT_PEER_FAILED`` (75): it ended because another process failed, or
  because the job was torn down;
* ``stopped``: pslaunch stopped it (teardown);
* ``done``: a worker ended from outside (SIGKILL, SIGTERM, ...) after the scheduler took its finish
  (``ProcessHandle.ended_after_its_part``): the training had all of it, so it is no failure;
* ``ok``: it exited 0.

The root cause (``culprit``) is the ``own`` process that failed first (by when pslaunch learned
it), else the ``peer`` process that ended first; ``stopped`` processes never are. Pure functions of
the handles' state: the supervisor calls them once every reader thread has finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pscontract import EXIT_PEER_FAILED

if TYPE_CHECKING:
    from ..backends.base import ProcessHandle

__all__ = ["Failure", "kind_of", "culprit", "notes", "who", "job_exit_code", "RESERVED_CODES"]

#: pslaunch's own exit codes (bad input, pre-flight, rsync, spawn): a process's code among them
#: makes pslaunch exit 1, so that they keep meaning "pslaunch could not start the job".
RESERVED_CODES = frozenset({2, 3, 4, 5})


@dataclass(frozen=True)
class Failure:
    """Why the job failed: a sentence for the root-cause line, the exit code, and the process."""

    reason: str
    exit_code: int
    handle: "ProcessHandle | None" = None
    exit_note: str = ""  # why pslaunch's exit code is not the process's: said only when the job ends with it
    quoted: tuple[str, ...] = ()  # lines to quote under it instead of the process's last ones (a stalled worker's stack)

    @property
    def final_reason(self) -> str:
        """The root-cause sentence of a job that ends with this failure (with its exit-code note)."""
        return self.reason + self.exit_note


def kind_of(handle: "ProcessHandle", stopped: set[int]) -> str:
    """``own``, ``peer``, ``stopped``, ``done``, ``ok`` or ``running`` (see the module docstring)."""
    if handle.failed_at is not None:
        return "own"
    status = handle.status
    if status is None:
        return "running"
    if status.ok:
        return "ok"
    if id(handle) in stopped:
        return "stopped"
    if handle.ended_after_its_part:
        return "done"
    if status.signal is None and status.code == EXIT_PEER_FAILED:
        return "peer"
    return "own"


def _when(handle: "ProcessHandle") -> float:
    if handle.failed_at is not None:
        return handle.failed_at
    return handle.ended if handle.ended is not None else float("inf")


def who(handle: "ProcessHandle") -> str:
    """``worker.1@host (worker rank 1 on host, pid 42)``: how the report names a process."""
    spec = handle.spec
    pid = f", pid {handle.pid}" if handle.pid else ""
    return f"{spec.name} ({spec.role} rank {spec.rank} on {spec.host.label}{pid})"


def job_exit_code(code: int) -> tuple[int, str]:
    """pslaunch's exit code for a root cause that exited with ``code``, and a note when they differ."""
    if code in RESERVED_CODES:
        return 1, f"; pslaunch exits 1 because it keeps {min(RESERVED_CODES)}-{max(RESERVED_CODES)} for its own errors"
    return code, ""


def culprit(handles: "list[ProcessHandle]", stopped: set[int]) -> Failure | None:
    """The root cause among ``handles`` (``stopped``: ids of the handles pslaunch stopped), or None
    when no process failed."""
    kinds = {id(h): kind_of(h, stopped) for h in handles}
    own = sorted((h for h in handles if kinds[id(h)] == "own"), key=_when)
    if own:
        first = own[0]
        status = first.status
        if first.unreachable and status is not None:
            host = first.spec.host
            names = ", ".join(h.spec.name for h in handles if h.unreachable and h.spec.host == host)
            return Failure(f"host {host.label} lost ({status.detail}): pslaunch could not reach {names}", 255, first)
        was_stopped = id(first) in stopped
        if status is not None and not status.ok and not was_stopped:
            code, note = job_exit_code(status.exit_code)
            return Failure(f"{who(first)} failed first: {status.describe()}", code, first, note)
        if status is None:
            then = ""
        elif was_stopped:
            then = f", then pslaunch stopped it ({status.describe()})"
        else:
            then = f", yet it exited with {status.describe()}"
        return Failure(f"{who(first)} failed first: it reported its own uncaught error{then}", 1, first)
    peers = sorted((h for h in handles if kinds[id(h)] == "peer"), key=_when)
    if peers:
        first = peers[0]
        return Failure(f"{who(first)} ended because another process failed (exit code {EXIT_PEER_FAILED}), and no "
                       "process was seen failing on its own; its last lines say which one it blamed",
                       EXIT_PEER_FAILED, first)
    return None


def notes(handles: "list[ProcessHandle]", stopped: set[int], failure: Failure | None) -> dict[int, str]:
    """The summary table's note for each handle id."""
    out = {}
    for h in handles:
        kind = kind_of(h, stopped)
        if failure is not None and failure.handle is h:
            out[id(h)] = "root cause, unreachable" if h.unreachable else "root cause"
        elif h.unreachable:
            out[id(h)] = "unreachable"  # pslaunch could not stop it: its host's guard does
        elif h.preempted is not None and h.preempted.get("checkpoint") is not None:  # a preempted job's worker 0
            out[id(h)] = f"preempted: committed checkpoint {h.preempted.get('checkpoint')}"
        elif kind == "own":
            out[id(h)] = "failed"
        elif kind == "peer":
            out[id(h)] = "ended: a peer failed"
        elif kind == "done":
            out[id(h)] = "ended after its part was done"
        elif id(h) in stopped:
            out[id(h)] = "stopped by pslaunch"
        elif kind == "running":
            out[id(h)] = "still running"
        elif h.left_at is not None:  # an elastic job's worker that left at a step boundary (SIGTERM)
            since = h.started if h.joined_at is None else h.joined_at
            out[id(h)] = ("" if h.joined_at is None else "joined the running job; ") + (
                f"left the job at {h.left_at - h.started:.1f}s, a member for {h.left_at - since:.1f}s")
        elif h.joined_at is not None:
            out[id(h)] = f"joined the running job {h.joined_at - h.started:.1f}s after its start"
        else:
            out[id(h)] = ""
    return out
