"""Worker 0's init calls, gathered so that keys initialised one call at a time are placed together.

Placement by bytes (``kvcore.stores.placement``) balances the servers over the keys it sees at once. A
script that inits a model one parameter per call, in any order, would hand it one key at a time,
and a greedy rule fed one key at a time cannot balance (ResNet-50's biggest tensors come last). So
worker 0's ``init`` only records its keys (with a copy of each value: the caller may change its
arrays as soon as init returns), and ``send`` places and initialises everything recorded at once:

- before worker 0's next call that reaches the servers (push, pull, a barrier, the optimizer, a
  checkpoint, close): ``flush``, on the caller's thread;
- or once worker 0 has made no init call for ``QUIET`` seconds, on a thread of this class: the other
  workers wait in their own ``init`` for the keys' places, and worker 0 may meanwhile wait for them
  elsewhere (a collective, a file), which must not hang.

An error ``send`` raises on that thread is kept and raised by the next ``flush`` (worker 0's next
call); the other workers hear of it through the placement book. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["DeferredInits", "QUIET"]

QUIET = 0.2  # seconds without an init call after which the recorded keys are sent anyway


class DeferredInits:
    """Init items recorded until ``flush`` or a quiet spell sends them (see the module docstring).

    ``send(items)`` gets every item recorded since the last send, in call order; it runs under this
    object's lock, so sends never overlap and ``flush`` returns only after a send in progress ended.
    """

    def __init__(self, send: Callable[[list[Any]], None], quiet: float = QUIET) -> None:
        self._send = send
        self._quiet = quiet
        self._items: list[Any] = []
        self._last_add = 0.0
        self._lock = threading.RLock()  # held while sending; a send may flush again (re-entrant)
        self._wake = threading.Condition(threading.Lock())
        self._error: BaseException | None = None
        self._sending = 0  # sends in progress (items taken, not yet on the servers)
        self._thread: threading.Thread | None = None
        self._closed = False

    def __bool__(self) -> bool:
        """True while items wait to be sent or are being sent, or an error of a send waits to be raised."""
        return bool(self._items) or self._sending > 0 or self._error is not None

    def add(self, items: list[Any]) -> None:
        """Record ``items``; they are sent by the next ``flush`` or after ``QUIET`` seconds."""
        with self._wake:
            self._items.extend(items)
            self._last_add = time.monotonic()
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._sender, name="kvcore-deferred-init", daemon=True)
                self._thread.start()
            self._wake.notify()

    def flush(self) -> None:
        """Send every recorded item now, on this thread (blocking); raise the error a send on the
        quiet-spell thread met, or this send's."""
        with self._lock:
            error, self._error = self._error, None
            if error is not None:
                raise error
            self._send_taken()

    def close(self) -> None:
        """Send what is recorded (blocking); no quiet-spell thread starts after this."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self.flush()

    def _send_taken(self) -> None:
        with self._wake:
            items, self._items = self._items, []
            if not items:
                return
            self._sending += 1
        try:
            self._send(items)
        finally:
            with self._wake:
                self._sending -= 1

    def _sender(self) -> None:
        while True:
            with self._wake:
                if not self._items or self._closed:
                    self._thread = None  # the next add starts another
                    return
                due = self._last_add + self._quiet - time.monotonic()
                if due > 0:
                    self._wake.wait(due)
                    continue
            with self._lock:
                try:
                    self._send_taken()
                except BaseException as exc:  # kept for worker 0's next call; the others learn it too
                    self._error = exc
