"""Leaving an elastic job at a step boundary (``-n MIN:MAX``; ``PSLAUNCH_MIN_WORKERS``).

A preempted pod or a spot notice sends the worker SIGTERM. In an elastic job the worker does not die
there: ``LeaveOnSignal`` notes it and the step under way finishes: at its step boundary (its next push
after the step's pulls, with every request answered) the worker tells every server that this push is
its last (``announce_leave``, so every other worker knows before it computes the next round), makes
the push and its pulls, and at the next step boundary leaves the job (``WorkerNode.leave``: every
node is told, the rounds after its last push go on without it); the process exits 0 (``SystemExit(0)``
raised from that push, so ``finally`` blocks and ``atexit`` run). A plain push/pull loop needs no
change; a script can read ``kv.leaving`` (True once its last push is announced) to end on its own
terms (``kv.close()`` then leaves). A second SIGTERM ends the process at once, as SIGTERM does
otherwise. The others take a change at their own next step boundary: ``kv.num_workers`` says the
members of their next round, and the script's ``State`` runs its reset callbacks
(``register_reset_callbacks``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

__all__ = ["LeaveOnSignal"]


class LeaveOnSignal:
    """One worker's SIGTERM; the store calls ``at_boundary`` at each of its step boundaries."""

    def __init__(self, worker: Any, store: Any = None) -> None:
        self.worker = worker
        self.store = store
        self.ranks = worker.elastic.members_next()  # the members the script sees, changed at step boundaries only
        self.asked = False
        self.last: int | None = None  # the round of this worker's last push, once announced
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():  # only there can Python install handlers
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal's signature
        if self.asked:  # the second: end now, as SIGTERM does
            signal.signal(signal.SIGTERM, self._previous if callable(self._previous) else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.asked = True
        print(f"worker {self.worker.rank}: SIGTERM: leaving the job at the next step boundary", file=sys.stderr,
              flush=True)

    @property
    def members(self) -> int:
        """How many members the script sees: those of the round its next push goes to, from the step
        boundary on (see ``settle``)."""
        return len(self.ranks)

    def settle(self) -> None:
        """Once the step's pulls are in (the store's step boundary is due): take a change of
        membership, the members the script sees and its ``State``'s reset callbacks. The script's
        first read of ``kv.num_workers`` after its pulls does it, or else its next push. Before the
        script's first push every read does it, and that push too: a joiner's store is made before
        it may hear of a worker that joins after it from the same start round (it hears of it
        before its ``State`` scalars come, so its first step counts it)."""
        ranks = self.worker.elastic.members_next()
        if ranks != self.ranks:
            self.ranks = ranks
            state = getattr(self.store, "script_state", None)
            if state is not None:
                state.on_reset()

    def at_boundary(self) -> None:
        """At a step boundary (``DistKVStore._step_boundary``, before the push that starts a step):
        send the scalars a joiner waits for, leave now when this worker's last push was announced,
        announce it when SIGTERM came, and take a change of membership (``settle``)."""
        if self.worker.elastic.owed:  # a joiner waits for this worker's scalars (psnode.worker.elastic)
            self.worker.elastic.at_boundary(self._scalars)
        if self.last is not None:
            self.leave()
        if self.asked and self.last is None:  # this step's push is the last: all hear it before that round closes
            self.last = self.worker.elastic.announce_leave()
        self.settle()

    def _scalars(self) -> dict:
        state = getattr(self.store, "script_state", None)
        return dict(state.scalars) if state is not None else {}

    def leave(self, exit: bool = True) -> None:
        """Leave the job; with ``exit``, end the process with exit code 0 (``kv.close()`` returns)."""
        rank = self.worker.rank
        remaining = self.worker.leave()
        print(f"worker {rank} left the job at a step boundary (SIGTERM); {remaining} "
              f"{'worker goes' if remaining == 1 else 'workers go'} on", file=sys.stderr, flush=True)
        if exit:
            raise SystemExit(0)
