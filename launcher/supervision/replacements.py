"""Workers replaced in place (``--restart-scope worker``): which process, when, and how long the
rounds it owed waited.

The supervisor adds a pair of handles each time it starts a failed worker again alone (``add``):
the one that ended and its replacement. The times come from them: the predecessor's end as
pslaunch saw it (within a tick of the supervisor's loop), the replacement's start, and two marker
lines its runtime writes in a ``dist_sync`` job (``psnode.worker.node``): ``RESUMED`` (it found its
predecessor's last mark and resumes from its scalars) and ``CAUGHT-UP`` (its first push that its
predecessor had not sent, or its end when it had nothing new to push: from then on the rounds it
owed go on). ``waited_s``, from the end to ``CAUGHT-UP``, is the longest any of those rounds waited
for it. A job without marks (``dist_async``, a script that does not use the runtime) writes neither:
its times stay None.

``records()`` gives frozen ``Replacement``s of the moment: for the live table (while the pair runs,
``caught_up_s`` may still be None), ``RunResult.replacements``, ``--summary-json`` and the summary's
lines (``lines``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..backends.base import ProcessHandle

__all__ = ["Replacement", "ReplacementLog"]


@dataclass(frozen=True)
class Replacement:
    """One worker that pslaunch started again alone, with its rank, while the job went on. Times are
    seconds since the job started."""

    process: str  # worker.1@host
    rank: int
    host: str
    restart: int  # the replacement's PSLAUNCH_RESTART_COUNT
    old_pid: int | None
    new_pid: int | None
    ended: str  # how the predecessor ended: "signal SIGKILL", "exit code 1"
    ended_s: float  # when pslaunch saw the predecessor end
    started_s: float  # when pslaunch started the replacement
    resumed_s: float | None  # it found its predecessor's last mark (None: not yet, or no marks)
    resumed_from: dict[str, Any] | None  # the scalars of that mark (None: none, it began anew)
    caught_up_s: float | None  # its first new push: the rounds it owed go on (None: not yet, or no marks)

    @property
    def waited_s(self) -> float | None:
        """The longest any round the worker owed waited for it: from its end to its replacement's
        first new push (None until then, and in a job without marks)."""
        return None if self.caught_up_s is None else round(self.caught_up_s - self.ended_s, 3)

    def as_dict(self) -> dict[str, Any]:
        """The ``--summary-json`` entry (``waited_s`` included)."""
        return {**asdict(self), "waited_s": self.waited_s}

    def describe(self) -> str:
        """One line: who, when, how it ended, how it resumed and how long the others waited."""
        text = (f"{self.process} replaced in place at {self.ended_s:.1f} s ({self.ended}; pid {self.old_pid or '-'} "
                f"-> {self.new_pid or '-'}, restart {self.restart})")
        if self.process.startswith(("server.", "replica.")):  # --server-replicas: it comes back as a replica
            if self.resumed_s is None:
                return text + "; as a replica, it had not received its server's keys when the job ended"
            return (text + f": a replica again, holding its server's keys {self.resumed_s - self.ended_s:.1f} s after "
                    "the end (a replica served in its place meanwhile)")
        if self.process.startswith("scheduler."):  # it holds no training state: the nodes come back to it
            if self.resumed_s is None:
                return text + "; the job's nodes had not come back to it when the job ended"
            return (text + f": the job's nodes were back with it {self.resumed_s - self.ended_s:.1f} s after the end "
                    "(pushes and pulls went on meanwhile; barriers and finishes waited)")
        if self.resumed_s is not None:
            where = (f"its predecessor's last mark {_scalars(self.resumed_from)}" if self.resumed_from is not None
                     else "the beginning (no mark)")
            text += f": resumed from {where} {self.resumed_s - self.ended_s:.1f} s after the end"
        if self.waited_s is not None:
            text += f"; the others waited {self.waited_s:.1f} s for it"
        elif self.resumed_s is not None:
            text += "; it had not caught up when the job ended"
        return text


def _scalars(scalars: dict[str, Any] | None) -> str:
    text = json.dumps(scalars, separators=(", ", "="))[1:-1].replace('"', "")
    return f"({text[:80]}{'...' if len(text) > 80 else ''})"


class ReplacementLog:
    """The replacements of one job, oldest first (see the module docstring). Not thread-safe: the
    supervisor's thread adds, any reader takes ``records()`` (the handles' fields it reads are set
    once each by their reader threads)."""

    def __init__(self, job_started: float) -> None:
        self.job_started = job_started  # time.monotonic() at the job's start
        self._pairs: list[tuple[ProcessHandle, ProcessHandle, int]] = []

    def add(self, ended: "ProcessHandle", replacement: "ProcessHandle", restart: int) -> None:
        """``replacement`` was started in place of ``ended`` (restart number ``restart``)."""
        self._pairs.append((ended, replacement, restart))

    def __len__(self) -> int:
        return len(self._pairs)

    def records(self) -> tuple[Replacement, ...]:
        """Each replacement as it stands now."""
        t0 = self.job_started

        def at(moment: float | None) -> float | None:
            return None if moment is None else round(moment - t0, 3)

        out = []
        for old, new, restart in self._pairs:
            status = old.status
            out.append(Replacement(
                process=new.spec.name, rank=new.spec.rank, host=new.spec.host.label, restart=restart,
                old_pid=old.pid, new_pid=new.pid, ended="running" if status is None else status.describe(),
                ended_s=at(old.ended if old.ended is not None else new.started) or 0.0, started_s=at(new.started) or 0.0,
                resumed_s=at(new.resumed_at), resumed_from=new.resumed_from, caught_up_s=at(new.caught_up_at)))
        return tuple(out)

    def lines(self) -> list[str]:
        """The summary's lines, one per replacement."""
        return [record.describe() for record in self.records()]
