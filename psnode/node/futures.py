"""One future completing after another once some work is done: a copy back, an upload, an unpacking.

A collective or a pull often has one more step after the data arrived (copy a sum out of a fused
buffer, upload it to a GPU, copy it into a non-contiguous out). ``chain`` makes the future a caller
waits on complete only after that step, with the step's error if it fails: a waiter never sees
"done" before the data is in place. ``set_result`` and ``set_error`` complete a future that
another thread may have completed first (a failure racing a result): the first one stands.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

__all__ = ["chain", "set_result", "set_error"]


def chain(inner: concurrent.futures.Future, outer: Any, action: Callable[[], Any] | None = None,
          result: Any = None) -> Any:
    """Complete ``outer`` once ``inner`` is done: with ``inner``'s error, or else after ``action()``
    (with its error, if it raises) with ``result``. Returns ``outer``.

    ``action`` runs on the thread that completes ``inner`` (often the one receiving for the node):
    keep it short.
    """

    def done(finished: concurrent.futures.Future) -> None:
        error = finished.exception()
        if error is None and action is not None:
            try:
                action()
            except Exception as exc:  # the step failed (a GPU copy): the waiter gets why
                error = exc
        try:
            if error is None:
                outer.set_result(result)
            else:
                outer.set_exception(error)
        except concurrent.futures.InvalidStateError:  # completed meanwhile (the node failed)
            pass

    inner.add_done_callback(done)
    return outer


def set_result(future: concurrent.futures.Future) -> None:
    """Complete ``future`` with None unless it is done already."""
    try:
        future.set_result(None)
    except concurrent.futures.InvalidStateError:
        pass


def set_error(future: concurrent.futures.Future, error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless it is done already."""
    try:
        future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
