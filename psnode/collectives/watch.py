"""The collectives' watcher: one thread per worker that finishes and watches ops nobody else looks at.

- An op whose result is in place but whose zero-copy sends are still leaving completes as soon as
  they left (``completing``): it waits on the transport's trackers, then wakes the transport so a
  caller blocked in a poll sees the future done at once.
- An op that still waits for a worker that finished the job fails, naming it, ``LEFT_GRACE``
  seconds after the news (the time that worker's last messages get to arrive).
- An op that waited ``PSLAUNCH_STALL_WARN`` seconds is said stalled, with the workers it waits for
  (Horovod's stall check): workers that run different collectives are not told otherwise; past
  ``PSLAUNCH_STALL_TIMEOUT`` it ends the job (``psnode.node.stalls``).

Started with the first op; stops when the worker fails or closes. Its lock guards its own lists; it
reads the engine's ops through ``Engine.ops_snapshot`` and fails them through ``Engine.abort``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from psnode.errors import PeerDiedError, PSNodeError
from psnode.node.protocol import Cmd
from psnode.node.stalls import StallClock, say_stall

from .base import Op

__all__ = ["Watcher", "LEFT_GRACE"]

# Seconds a finished worker's last messages get before ops still waiting for it fail. Its messages
# left before it finished, but on a loaded machine the receiving thread may not have read them yet:
# a worker that leaves early is a program's error, so this errs on the side of waiting.
LEFT_GRACE = 5.0
_TICK = 0.05


class Watcher:
    """The watcher of one engine (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._completing: list[Op] = []
        self._left: dict[int, tuple[float, str]] = {}
        self._clock = StallClock.of(engine.conn.env)  # which ops were said stalled
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sending = threading.Event()  # an op waits for its tracked sends

    def start(self) -> None:
        """Start the thread (once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"psnode-collectives-{self.engine.rank}",
                                                daemon=True)
                self._thread.start()

    @property
    def started(self) -> bool:
        """Whether the thread was started."""
        return self._thread is not None

    def complete_when_sent(self, op: Op) -> None:
        """Complete ``op``'s future once its tracked sends have left."""
        with self._lock:
            self._completing.append(op)
        self._sending.set()

    def pending(self) -> list[Op]:
        """The ops waiting for their sends."""
        with self._lock:
            return list(self._completing)

    def take_all(self) -> list[Op]:
        """Forget the ops waiting for their sends (the worker failed); them."""
        with self._lock:
            ops, self._completing = self._completing, []
        return ops

    def peer_left(self, rank: int, description: str) -> None:
        """Worker ``rank`` finished the job (``description`` names it)."""
        with self._lock:
            self._left[rank] = (time.monotonic(), description)

    def stop(self) -> None:
        """End the thread at its next turn."""
        self._stop.set()
        self._sending.set()

    def _run(self) -> None:
        next_check = 0.0
        while not self._stop.is_set():
            try:
                if not self._wait_sent():
                    self._sending.wait(_TICK)
                    self._sending.clear()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + _TICK
                    self._fail_left(now)
                    self._warn_stalled(now)
            except Exception as exc:  # never die silently: the ops it watches would wait forever
                self.engine.conn.failure.fail(PSNodeError(
                    f"worker {self.engine.rank}'s collectives watcher failed: {type(exc).__name__}: {exc}"))
                return

    def _wait_sent(self) -> bool:
        """Wait a moment for the first op's tracked sends; complete every op whose sends all left.
        False when no op waits for its sends."""
        with self._lock:
            if not self._completing:
                return False
            first = self._completing[0]
        for tracker in first.trackers:
            if not tracker.done:
                try:
                    tracker.wait(_TICK)  # returns as soon as the transport let go of the frame
                except Exception:  # not done within the tick (ZeroMQ's NotDone): look again
                    pass
                break
        with self._lock:
            ready = [op for op in self._completing if all(t.done for t in op.trackers)]
            if ready:
                self._completing = [op for op in self._completing if op not in ready]
        for op in ready:
            op.trackers = []
            self.engine.finish(op)
        if ready:
            self.engine.conn.transport.wake()
        return True

    def _fail_left(self, now: float) -> None:
        with self._lock:
            gone = {r: d for r, (t, d) in self._left.items() if now - t > LEFT_GRACE}
        if not gone:
            return
        engine = self.engine
        for op in engine.ops_snapshot():
            with op.lock:
                waiting = op.waiting_for() & gone.keys() if not op.future.done() else set()
                if waiting:
                    rank = min(waiting)
                    peer = engine.conn.members.workers[rank]
                    engine.abort(op, PeerDiedError(
                        f"{gone[rank]} finished the job while {op.describe()} on worker {engine.rank} still waits "
                        "for it: every worker must run the same collectives", "worker", rank, peer.host), tell=False)

    def _warn_stalled(self, now: float) -> None:
        """Say an op that waited past a stall threshold, once per threshold (``psnode.node.stalls``);
        past ``PSLAUNCH_STALL_TIMEOUT`` in a job started by hand, fail the worker with it."""
        clock = self._clock
        ops = [op for op in self.engine.ops_snapshot() if not op.future.done()]
        clock.forget({op.tag for op in ops})
        members = self.engine.conn.members.workers
        for op in ops:
            if now - op.started < clock.least:
                continue
            with op.lock:
                waiting = sorted(op.waiting_for())
            level = clock.due(op.tag, now - op.started) if waiting else None
            if level is None:
                continue
            hosts = ", ".join(f"worker {w} on {members[w].host if 0 <= w < len(members) else '?'}" for w in waiting)
            text = (f"stalled: {op.describe()} has waited {now - op.started:.0f} s ({clock.setting(level)}) for "
                    f"{hosts}; every worker must run the same collectives (the same keys, as often)")
            error = say_stall(self.engine.conn.env, f"worker {self.engine.rank}", text, waiting, level,
                              self.engine.conn.timeline, now - op.started, op.describe())
            if error is not None:  # a job started by hand: every node hears why it ends
                self.engine.conn.link.send(Cmd.NODE_DIED, body={"message": str(error)})
                self.engine.conn.failure.fail(error)
