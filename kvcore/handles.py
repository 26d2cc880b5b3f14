"""Handles for operations that may complete later: what push and pull return.

A ``Handle`` is a ``concurrent.futures.Future`` with the KVStore's vocabulary: ``wait(timeout)``
blocks until the operation is done and raises its error, ``done()`` polls, and
``add_done_callback(fn)`` runs ``fn(handle)`` once it completes (at once when it already has). The
local store completes every operation before returning, so its handles are already done; distributed
stores complete them from their network thread.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Iterable

from .errors import KVTimeoutError

__all__ = ["Handle", "completed", "wait_all"]


class Handle(concurrent.futures.Future):
    """The pending result of one push, pull or pushpull.

    Thread-safe: it may be waited on from any thread.
    """

    def __init__(self, description: str = "operation") -> None:
        super().__init__()
        self.description = description

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation completes; return its result or raise its error.

        Raises:
            KVTimeoutError: not complete within ``timeout`` seconds (the operation goes on).
        """
        try:
            return self.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise KVTimeoutError(f"{self.description} did not complete within {timeout} s") from exc

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Handle {self.description} {state}>"


_MAKE_CONDITION = threading.Lock()  # makes a LazyHandle's condition exactly once
_PENDING, _FINISHED = "PENDING", "FINISHED"  # concurrent.futures.Future's state names


class LazyHandle(Handle):
    """A ``Handle`` that makes its lock only when someone needs it.

    A ``concurrent.futures.Future`` builds a ``threading.Condition`` when it is made and takes it
    to complete; a distributed store makes two handles per push + pull round, and nobody waits on
    most of them (a push's handle) or waits through the store (``wait``, which looks at the state
    first). This one behaves the same, but its condition is made on first use (``result``,
    ``done``, ``add_done_callback``, ``concurrent.futures.wait`` ...), and completing it takes no
    lock while there is none. The state is written before the condition is looked at, and every
    waiter looks at the state under the condition after making it, so a waiter arriving at the
    same moment either sees the result or is notified.
    """

    def __init__(self, description: str = "operation") -> None:
        # concurrent.futures.Future.__init__'s fields, but no condition yet (see _condition)
        self._state = _PENDING
        self._result = None
        self._exception = None
        self._waiters: list = []
        self._done_callbacks: list = []
        self._lazy_condition: threading.Condition | None = None
        self.description = description

    @property
    def _condition(self) -> threading.Condition:  # what Future's methods use
        condition = self._lazy_condition
        if condition is None:
            with _MAKE_CONDITION:
                condition = self._lazy_condition
                if condition is None:
                    condition = self._lazy_condition = threading.Condition()
        return condition

    def set_result(self, result: Any) -> None:
        if not self._finish_without_lock("_result", result, "add_result"):
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._finish_without_lock("_exception", exception, "add_exception"):
            super().set_exception(exception)

    def _finish_without_lock(self, field: str, value: Any, tell: str) -> bool:
        """Complete with ``value`` in ``field`` while no condition exists; False: someone waits or
        looked (or it is done already), so Future's own completion (and its errors) must run."""
        if self._lazy_condition is not None or self._state != _PENDING:
            return False
        setattr(self, field, value)
        self._state = _FINISHED
        if self._lazy_condition is not None:  # a waiter came meanwhile: wake it
            self._notify_late(tell)
        return True

    def _notify_late(self, tell: str) -> None:
        """Wake what started waiting between the state's write and the look for a condition
        (``tell``: the name of the waiters' method, ``add_result`` or ``add_exception``)."""
        with self._condition:
            for waiter in self._waiters:
                getattr(waiter, tell)(self)
            self._condition.notify_all()
        self._invoke_callbacks()

    def wait(self, timeout: float | None = None) -> Any:
        if self._state == _FINISHED:  # done: no lock needed to read it
            if self._exception is not None:
                raise self._exception
            return self._result
        return super().wait(timeout)


def completed(result: Any = None, description: str = "operation") -> Handle:
    """A handle that is already done with ``result``."""
    handle = Handle(description)
    handle.set_result(result)
    return handle


def wait_all(handles: Iterable[Handle], timeout: float | None = None) -> None:
    """Wait for every handle in turn, with ``timeout`` applying to each."""
    for handle in handles:
        handle.wait(timeout)
