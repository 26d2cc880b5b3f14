"""Which thread receives for a worker: its network thread, or a caller waiting for a reply.

One thread at a time receives (polls, reads, dispatches through the ``node.Connection``). Normally
that is the worker's network thread. A caller blocked in ``wait_for`` takes the role over, so the
reply it waits for wakes it directly instead of passing through the network thread (a thread
wake-up less per round trip, which is most of a small key's cost). When the caller is done the
network thread does not take the role straight back: it parks for ``HANDBACK`` so that a caller in
a loop of waits keeps it without a hand-over each time; when it wakes it sends the push the outbox
held back for a pull that did not come (``worker_outbox.HeldPush``).

``waited`` counts the seconds callers spent blocked in ``wait_for`` (``waiting_since`` says since when
one is blocked now), for the heartbeats' report; with a ``timeline`` each blocked wait is an event.

State (``_lock`` is held by whichever thread receives): ``_owner`` is that thread, ``_caller`` a
caller that takes or holds the role, ``_released`` when a caller last gave it up.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

from psnode.errors import ClosedError, PSNodeError
from psnode.node.connection import Connection
from psnode.node.futures import is_done
from psnode.worker.outbox import Outbox

__all__ = ["Receiver", "HANDBACK"]

# After a caller stops receiving (wait_for), the network thread takes the role back only once no
# caller has received for this long: a caller in a loop of waits keeps it without a hand-over each
# time. Messages that arrive in such a gap wait at most this long (heartbeats are unaffected).
HANDBACK = 0.002


class Receiver:
    """The receiving role of one worker and its network thread (see the module docstring)."""

    def __init__(self, conn: Connection, outbox: Outbox) -> None:
        self.conn = conn
        self.outbox = outbox
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._caller: int | None = None
        self._released = 0.0
        self._caller_lock = threading.Lock()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.waited = 0.0  # seconds callers spent blocked in wait_for, ended waits (heartbeats report it)
        self.waiting_since = 0.0  # when the wait in progress began (0: none), so a stuck wait shows too
        self.timeline: Any = None  # PSLAUNCH_TIMELINE: each blocked wait is an event

    def start(self, name: str) -> None:
        """Start the network thread."""
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def stop(self, join: float = 2.0) -> None:
        """Stop the network thread (it leaves its poll at once) and wait up to ``join`` seconds for it."""
        self._stop.set()
        self.outbox.held.wake()
        self.conn.transport.wake()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=join)

    def _run(self) -> None:
        me = threading.get_ident()
        outbox = self.outbox
        while not self._stop.is_set():
            if self._caller is not None or time.monotonic() - self._released < HANDBACK:
                # a caller receives, or did a moment ago and is likely to wait again soon: leave the
                # role to it rather than take it back and be woken to hand it over at its next wait
                held = outbox.held.park(HANDBACK, self._stop)
                if held is not None:  # a held push waited long enough for a pull to join it
                    outbox.requeue(held)
                    outbox.pump()
                continue
            with self._lock:
                self._owner = me
                try:
                    if self._caller is None:  # checked after naming the owner: see _take
                        self.receive(0.02 if outbox.queue else 0.1)
                except PSNodeError:  # ClosedError, or a failure receive recorded
                    return
                finally:
                    self._owner = None

    def receive(self, timeout: float, until: Any = None) -> None:
        """One turn of receiving (hold the role): messages, heartbeats, and queued sends.

        ``until``: a future whose completion ends the turn (what a waiting caller waits for).
        """
        try:
            self.conn.process(timeout, until)
            if self.outbox.queue:
                self.outbox.pump()
        except ClosedError:
            raise
        except Exception as exc:  # a bug must not leave the receiving thread dead silently
            self.conn.failure.fail(PSNodeError(
                f"receiving on {self.conn.describe()} failed: {type(exc).__name__}: {exc}"))
            raise self.conn.failure.error from exc

    def wait_for(self, future: concurrent.futures.Future, timeout: float | None = None) -> bool:
        """Block until ``future`` is done or ``timeout`` seconds passed; True when done (any thread).

        While no other caller does, this thread receives for the node itself, so the reply wakes
        it directly. It does not raise the future's error (read it from the future).

        Raises:
            PSNodeError: the node failed (the failure, e.g. ``PeerDiedError``) or was closed.
        """
        if self.outbox.held.item is not None:  # a caller that waits sends what it held back first
            self.outbox.release_held()
            self.outbox.pump()
        if is_done(future):
            return True
        started_ns = time.monotonic_ns()
        started = self.waiting_since = started_ns / 1e9
        deadline = None if timeout is None else started + timeout
        me = threading.get_ident()
        failure = self.conn.failure
        try:
            while not is_done(future):
                if failure.error is not None:
                    raise failure.error
                step = 0.1
                if deadline is not None:
                    step = min(step, deadline - time.monotonic())
                    if step <= 0:
                        return False
                if self._owner == me:  # a callback on the receiving thread waits: keep receiving here
                    self.receive(step)
                    continue
                if self._stop.is_set() or not self._take(me):
                    concurrent.futures.wait([future], step)  # whoever receives completes it
                    continue
                try:
                    while failure.error is None:
                        if deadline is not None:
                            step = deadline - time.monotonic()
                            if step <= 0:
                                break
                        # the thread that had the role may have completed the future while handing it
                        # over: then take what is already here, but do not wait for more
                        done = is_done(future)
                        self.receive(0.0 if done else min(step, 0.1), future)
                        if done or is_done(future):
                            break
                finally:
                    self._release()
            return True
        finally:
            self.waiting_since = 0.0
            ended_ns = time.monotonic_ns()
            self.waited += (ended_ns - started_ns) / 1e9  # two threads waiting at once may lose a share
            if self.timeline is not None:
                self.timeline.add("wait", None, started_ns, ended_ns)

    def _take(self, me: int) -> bool:
        """Take the receiving role (from the network thread); False when another caller has it."""
        with self._caller_lock:
            if self._caller is not None:
                return False
            self._caller = me
        if self._owner is not None:  # the network thread polls: make it leave its poll now
            self.conn.transport.wake()
        while not self._lock.acquire(timeout=0.1):
            if self.conn.failure.error is not None or self._stop.is_set():
                self._release(locked=False)
                return False
        self._owner = me
        return True

    def _release(self, locked: bool = True) -> None:
        """Give the receiving role up; the network thread takes it after ``HANDBACK`` without a caller."""
        self._released = time.monotonic()
        if locked:
            self._owner = None
            self._lock.release()
        self._caller = None
