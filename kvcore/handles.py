"""Handles for operations that may complete later: what push and pull return.

A ``Handle`` is a ``concurrent.futures.Future`` with the KVStore's vocabulary: ``wait(timeout)``
blocks until the operation is done and raises its error, ``done()`` polls, and
``add_done_callback(fn)`` runs ``fn(handle)`` once it completes (at once when it already has). The
local store completes every operation before returning, so its handles are already done; distributed
stores complete them from their network thread.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable

from .errors import KVStoreError

__all__ = ["Handle", "KVTimeoutError", "completed", "wait_all"]


class KVTimeoutError(KVStoreError, TimeoutError):
    """A wait on a handle ran past its timeout."""


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


def completed(result: Any = None, description: str = "operation") -> Handle:
    """A handle that is already done with ``result``."""
    handle = Handle(description)
    handle.set_result(result)
    return handle


def wait_all(handles: Iterable[Handle], timeout: float | None = None) -> None:
    """Wait for every handle in turn, with ``timeout`` applying to each."""
    for handle in handles:
        handle.wait(timeout)
