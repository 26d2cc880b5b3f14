"""Work a server hands to a thread of its own, run in the order given, whose outcomes come back to the
server's loop.

A server's loop must go on serving (heartbeats, other requests) while a checkpoint's files are synced
to disk, which can take seconds. ``BackgroundWork.submit(work, then)`` queues ``work`` (run on the
one background thread, in submission order); once it is done, the loop's next ``finished()`` calls
``then(ok, value)`` there, on the loop's own thread, where replies may be sent (the transport is
not thread-safe). ``busy`` tells the loop to look again soon.

``close(timeout)`` lets queued work finish for at most ``timeout`` seconds; work that waits on
something (another server's file) asks ``stopping()`` and gives up once the deadline has passed.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable

__all__ = ["BackgroundWork"]

_Then = Callable[[bool, Any], None]


class BackgroundWork:
    """One background thread and its queue (see the module docstring); ``name`` names the thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque = collections.deque()  # (then, ok, value), appended by the thread
        self._queued = 0  # submitted and not yet handed back by finished()
        self._count = threading.Lock()  # a test may submit from its own thread
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None  # set by close: queued work must be done by then

    @property
    def busy(self) -> bool:
        """True while work is queued, running, or done and not yet handed back."""
        return self._queued > 0

    def submit(self, work: Callable[[], Any], then: _Then | None = None) -> None:
        """Queue ``work()``; ``then(True, its result)`` or ``then(False, its exception)`` is called by
        a later ``finished()``."""
        with self._count:
            self._queued += 1
            self._queue.put((work, then))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def finished(self) -> None:
        """Hand back every outcome of work done since the last call (call it from the loop)."""
        while self._done:
            then, ok, value = self._done.popleft()
            with self._count:
                self._queued -= 1
            if then is not None:
                then(ok, value)

    def stopping(self) -> bool:
        """True once ``close`` was called and its deadline has passed: waiting work gives up."""
        return self._deadline is not None and time.monotonic() > self._deadline

    def close(self, timeout: float) -> None:
        """Let queued work finish for at most ``timeout`` seconds, then hand back what finished."""
        self._deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
        self.finished()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, then = item
            try:
                outcome = (then, True, work())
            except BaseException as exc:  # handed to the loop
                outcome = (then, False, exc)
            self._done.append(outcome)
