"""A preempted job keeps its place: worker 0 commits a checkpoint at its next step boundary.

When a whole job is preempted (Slurm's ``--signal``, a Kubernetes pod deleted), pslaunch gets SIGTERM.
With a checkpoint directory it sends worker 0 the runtime's preempt signal (``pscontract.preempt_signal``)
before it stops anything. ``PreemptOnSignal`` notes it; at worker 0's next step boundary (its next push
after the step's pulls, every request answered) the ``kvcore.elastic.State`` of the script commits a
checkpoint alone: worker 0's pulls of the step are answered, so every round of the step is applied,
and no round of the next can close without worker 0's push, so the servers hold exactly the values
after the step, which go to disk with worker 0's scalars (``commit(wait=True)``). Worker 0 then says
so (``PSLAUNCH-PREEMPTED``), leaves the job without finishing it and exits ``EXIT_PREEMPTED``; pslaunch
stops the rest and exits with the same code. Running the same command again resumes from that
checkpoint (``state.restore()``).

A script without a ``State``, or a job without a checkpoint directory, has nothing to commit: worker 0
says so and pslaunch stops the job at once, as SIGTERM always did.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import Any

from pscontract import EXIT_PREEMPTED, MARKER_PREEMPTED, preempt_signal

__all__ = ["PreemptOnSignal"]


class PreemptOnSignal:
    """One worker's preempt signal; the store calls ``at_boundary`` at each of its step boundaries."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.asked = False
        if threading.current_thread() is threading.main_thread():  # only there can Python install handlers
            signal.signal(preempt_signal(), self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal's signature
        self.asked = True

    def at_boundary(self) -> None:
        """At a step boundary (``DistKVStore._step_boundary``): once preempted, commit and exit."""
        if self.asked:
            self.asked = False
            self.commit_and_exit()

    def commit_and_exit(self) -> None:
        store = self.store
        worker = store._worker
        state = store.script_state
        if state is None or store.job.checkpoint_dir is None:
            why = "no kvcore.elastic.State" if state is None else "no checkpoint directory (--checkpoint-dir)"
            print(f"worker {worker.rank}: preempted, but the job has {why}: nothing to commit", file=sys.stderr,
                  flush=True)
            worker.tell_launcher(f"{MARKER_PREEMPTED} {json.dumps({'checkpoint': None, 'why': why})}")
            return
        checkpoint = state.commit_alone()
        worker.tell_launcher(f"{MARKER_PREEMPTED} {json.dumps({'checkpoint': checkpoint, 'scalars': state.scalars})}")
        print(f"worker {worker.rank}: preempted: committed checkpoint {checkpoint} at its step boundary "
              f"({', '.join(f'{k}={v!r}' for k, v in state.scalars.items())}); the same command resumes from it",
              file=sys.stderr, flush=True)
        worker.detach()
        raise SystemExit(EXIT_PREEMPTED)
