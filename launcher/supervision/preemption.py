"""pslaunch told to stop while the job keeps checkpoints: a preemption, not a failure.

Slurm's ``--signal`` and a deleted Kubernetes pod give pslaunch SIGTERM. With ``--checkpoint-dir``
pslaunch first sends worker 0 the runtime's preempt signal (``pscontract.preempt_signal``); at its
next step boundary worker 0 commits a checkpoint alone and exits ``EXIT_PREEMPTED``
(``kvcore.preempting``), saying which (a ``PREEMPTED`` marker). Then the job is stopped as any other
and pslaunch exits ``EXIT_PREEMPTED``: the same command resumes from that checkpoint. Worker 0 has
``--stop-grace`` seconds; a script that commits nothing (no ``State``), or takes longer, ends the job
as SIGTERM always did (exit 143, saying why; at once when worker 0 says it has nothing to commit). A second signal stops everything at once (the
supervisor's rule). Owned by the supervisor's loop (one thread).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Sequence

from pscontract import EXIT_PREEMPTED, preempt_signal

from .verdict import Failure

if TYPE_CHECKING:
    from ..backends.base import ProcessHandle

__all__ = ["Preemption", "EXIT_PREEMPTED"]

_STOPPED = Failure("pslaunch got SIGTERM", 128 + signal.SIGTERM)


class Preemption:
    """Worker 0's checkpoint before a preempted job stops (see the module docstring)."""

    def __init__(self, grace: float, note) -> None:
        self.grace = grace
        self.note = note  # the printer's note: a line of pslaunch's own
        self.handle: "ProcessHandle | None" = None  # worker 0, asked to commit
        self.started: float | None = None

    def step(self, handles: Sequence["ProcessHandle"], now: float) -> Failure | None:
        """None while worker 0 may still commit; then how the job ends."""
        if self.started is None:
            self.started = now
            worker0 = next((h for h in handles if h.spec.role == "worker" and h.spec.rank == 0 and h.status is None),
                           None)
            if worker0 is None or not worker0.signal_process(preempt_signal()):
                return _STOPPED
            self.handle = worker0
            self.note(f"got SIGTERM: the job is preempted; worker 0 commits a checkpoint at its next step boundary "
                      f"(within --stop-grace {self.grace:g} s), then the job stops")
            return None
        handle = self.handle
        assert handle is not None
        if handle.preempted is None and handle.status is not None:
            handle.settle_output()  # its marker comes before its exit
        if handle.preempted is not None and handle.preempted.get("checkpoint") is None:
            why = str(handle.preempted.get("why", "?"))[:200]
            return Failure(f"pslaunch got SIGTERM; worker 0 had nothing to commit (the job has {why})",
                           _STOPPED.exit_code)
        if handle.preempted is not None:
            checkpoint = handle.preempted.get("checkpoint")
            scalars = handle.preempted.get("scalars")
            at = "" if not isinstance(scalars, dict) else " (" + ", ".join(f"{k}={v!r}" for k, v in scalars.items()) + ")"
            return Failure(f"pslaunch got SIGTERM: the job was preempted after worker 0 committed checkpoint "
                           f"{checkpoint}{at}; the same command resumes from it", EXIT_PREEMPTED)
        if handle.status is not None:
            return Failure("pslaunch got SIGTERM; worker 0 ended without committing a checkpoint", _STOPPED.exit_code)
        if now - self.started > self.grace:
            return Failure(f"pslaunch got SIGTERM; worker 0 committed no checkpoint within --stop-grace {self.grace:g} s "
                           "(a kvcore.elastic.State and a step of kv.push and kv.pull commit one)", _STOPPED.exit_code)
        return None
