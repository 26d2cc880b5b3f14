"""Which thread receives for a worker: its network thread, or a caller waiting for a reply.

One thread at a time receives (polls, reads, dispatches). Normally that is the worker's network
thread. A caller blocked in ``wait_for`` takes the role over, so the reply it waits for wakes it
directly instead of passing through the network thread (a thread wake-up less per round trip,
which is most of a small key's cost). When the caller is done the network thread does not take
the role straight back: it parks for ``_HANDBACK`` so that a caller in a loop of waits keeps it
without a hand-over each time, and sends a push held back for a pull (see ``worker_sending``)
that no pull came for.

``ReceivingRole`` is mixed into ``WorkerNode`` and uses its state (see ``WorkerNode.__init__``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

from .errors import ClosedError, PSNodeError
from .node import is_done

__all__ = ["ReceivingRole"]

# After a caller stops receiving (wait_for), the network thread takes the role back only once no
# caller has received for this long: a caller in a loop of waits keeps it without a hand-over each
# time. Messages that arrive in such a gap wait at most this long (heartbeats are unaffected).
_HANDBACK = 0.002


class ReceivingRole:
    """The receiving role of a ``WorkerNode`` and its hand-over (see the module docstring)."""

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            if self._rx_caller is not None or time.monotonic() - self._rx_released < _HANDBACK:
                # a caller receives, or did a moment ago and is likely to wait again soon: leave the
                # role to it rather than take it back and be woken to hand it over at its next wait
                with self._rx_cond:
                    if not self._stop.is_set():
                        self._parked = True
                        self._rx_cond.wait(_HANDBACK)
                    self._parked = False
                if self._cork is not None:  # a held push waited long enough for a pull to join it
                    self._uncork()
                continue
            with self._rx_lock:
                self._rx_owner = me
                try:
                    if self._rx_caller is None:  # checked after naming the owner: see _take_receiver
                        self._receive(0.02 if self._queue else 0.1)
                except PSNodeError:  # ClosedError, or a failure _receive recorded
                    return
                finally:
                    self._rx_owner = None

    def _receive(self, timeout: float, until: Any = None) -> None:
        """One turn of receiving (hold ``_rx_lock``): messages, heartbeats, and queued sends.

        ``until``: a future whose completion ends the turn (what a waiting caller waits for).
        """
        try:
            self.process(timeout, until)
            if self._queue:
                self._pump()
        except ClosedError:
            raise
        except Exception as exc:  # a bug must not leave the receiving thread dead silently
            self.fail(PSNodeError(f"receiving on worker {self.rank} failed: {type(exc).__name__}: {exc}"))
            raise self.failure from exc

    def wait_for(self, future: concurrent.futures.Future, timeout: float | None = None) -> bool:
        """Block until ``future`` is done or ``timeout`` seconds passed; True when done (any thread).

        While no other caller does, this thread receives for the node itself, so the reply wakes
        it directly. It does not raise the future's error (read it from the future).

        Raises:
            PSNodeError: the node failed (the failure, e.g. ``PeerDiedError``) or was closed.
        """
        if self._cork is not None:  # a caller that waits sends what it held back first
            self._uncork()
        if is_done(future):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        while not is_done(future):
            if self.failure is not None:
                raise self.failure
            step = 0.1
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return False
            if self._rx_owner == me:  # a callback on the receiving thread waits: keep receiving here
                self._receive(step)
                continue
            if self._thread is None or self._closed or not self._take_receiver(me):
                concurrent.futures.wait([future], step)  # whoever receives completes it
                continue
            try:
                while self.failure is None:
                    if deadline is not None:
                        step = deadline - time.monotonic()
                        if step <= 0:
                            break
                    self._receive(min(step, 0.1), future)
                    if is_done(future):
                        break
            finally:
                self._release_receiver()
        return True

    def _take_receiver(self, me: int) -> bool:
        """Take the receiving role (from the network thread); False when another caller has it."""
        with self._park_lock:
            if self._rx_caller is not None:
                return False
            self._rx_caller = me
        if self._rx_owner is not None:  # the network thread polls: make it leave its poll now
            self.transport.wake()
        while not self._rx_lock.acquire(timeout=0.1):
            if self.failure is not None or self._stop.is_set():
                self._release_receiver(locked=False)
                return False
        self._rx_owner = me
        return True

    def _release_receiver(self, locked: bool = True) -> None:
        """Give the receiving role up; the network thread takes it after ``_HANDBACK`` without a caller."""
        self._rx_released = time.monotonic()
        if locked:
            self._rx_owner = None
            self._rx_lock.release()
        self._rx_caller = None

    def _stop_thread(self) -> None:
        self._stop.set()
        with self._rx_cond:
            self._rx_cond.notify_all()
        self.transport.wake()
