"""Futures that complete after others: one step after the data, or once all of several are done.

A collective or a pull often has one more step after the data arrived (copy a sum out of a fused
buffer, upload it to a GPU, copy it into a non-contiguous out). ``chain`` makes the future a caller
waits on complete only after that step, with the step's error if it fails: a waiter never sees
"done" before the data is in place. ``all_of`` does the same after several futures (the parts of
a fused allreduce, a Trainer's buckets), and ``when_all_done`` calls back once several are done,
whatever their outcome (an op that must wait for the ops before it). ``set_result`` and
``set_error`` complete a future that another thread may have completed first (a failure racing a
result): the first one stands. ``is_done`` asks without the future's lock.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any, Callable, Sequence

__all__ = ["is_done", "chain", "all_of", "when_all_done", "set_result", "set_error"]

_DONE_STATES = frozenset({"CANCELLED", "CANCELLED_AND_NOTIFIED", "FINISHED"})


def is_done(future: concurrent.futures.Future) -> bool:
    """``future.done()`` without taking the future's lock (reading one attribute is atomic).

    The receive loops ask this after every message; the lock ``done()`` takes is most of its cost.
    """
    return future._state in _DONE_STATES



def chain(inner: concurrent.futures.Future, outer: Any, action: Callable[[], Any] | None = None,
          result: Any = None) -> Any:
    """Complete ``outer`` once ``inner`` is done: with ``inner``'s error, or else after ``action()``
    (with its error, if it raises) with ``result``. Returns ``outer``.

    ``action`` runs on the thread that completes ``inner`` (often the one receiving for the node):
    keep it short.
    """
    inner.add_done_callback(functools.partial(_complete_after, outer, action, result))
    return outer


def all_of(futures: Sequence[concurrent.futures.Future], outer: Any, action: Callable[[], Any] | None = None,
           result: Any = None) -> Any:
    """``chain`` for several futures: complete ``outer`` once every one of ``futures`` is done,
    with the first error among them, or else after ``action()`` with ``result``. Returns ``outer``
    (completed at once when ``futures`` is empty)."""
    when_all_done(futures, lambda errors: _complete(outer, errors[0] if errors else None, action, result))
    return outer


def when_all_done(futures: Sequence[concurrent.futures.Future], callback: Callable[[list[BaseException]], Any]) -> None:
    """Call ``callback(errors)`` once every one of ``futures`` is done, whatever their outcome, with
    their errors in the order they came; on the thread that completes the last one, or on this one
    when none is pending."""
    if not futures:
        callback([])
        return
    left = [len(futures)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one_done(done: concurrent.futures.Future) -> None:
        error = done.exception()
        with lock:
            if error is not None:
                errors.append(error)
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback(errors)

    for future in futures:
        future.add_done_callback(one_done)


def _complete_after(outer: Any, action: Callable[[], Any] | None, result: Any, inner: Any) -> None:
    """``chain``'s callback (a partial: one frame per completion on the receiving thread)."""
    _complete(outer, inner.exception(), action, result)


def _complete(outer: Any, error: BaseException | None, action: Callable[[], Any] | None, result: Any) -> None:
    """Complete ``outer``: with ``error``, else after ``action()`` (its error if it raises) with ``result``."""
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
