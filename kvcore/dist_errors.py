"""The edge between the runtime's errors and kvcore's: one table, applied where kvcore calls psnode.

psnode raises its own tree (``psnode.errors``); a user of kvcore sees kvcore's
(``kvcore.errors``). ``translate`` maps one error through ``_TABLE`` (most specific first) and keeps
the psnode error as ``__cause__``; ``runtime_errors()`` applies it around a block that calls into
psnode, and ``@maps_runtime_errors`` around a whole method (the stores' push and pull, where a
``with`` per call would cost more than the call). The stores use nothing else to map errors, and the
handles they return translate what the runtime completed them with when it is read.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

from psnode import errors as ps

from .errors import DistributedError, DistTimeoutError, NodeDiedError, ServerError, WorkerMismatchError

__all__ = ["translate", "runtime_errors", "maps_runtime_errors"]

_Method = TypeVar("_Method", bound=Callable[..., Any])

_TABLE: tuple[tuple[type[BaseException], Callable[[BaseException], BaseException]], ...] = (
    (ps.PeerDiedError, lambda e: NodeDiedError(str(e), e.role, e.rank, e.host)),
    (ps.RemoteError, lambda e: ServerError(str(e))),
    (ps.MismatchError, lambda e: WorkerMismatchError(str(e))),
    (ps.NodeTimeoutError, lambda e: DistTimeoutError(str(e))),
    (ps.PSNodeError, lambda e: DistributedError(str(e))),
)


def translate(exc: BaseException) -> BaseException:
    """The kvcore error for a psnode error, with it as ``__cause__``; any other error as it is."""
    for kind, make in _TABLE:
        if isinstance(exc, kind):
            new = make(exc)
            new.__cause__ = exc
            return new
    return exc


@contextlib.contextmanager
def runtime_errors() -> Iterator[None]:
    """Raise kvcore's error for any psnode error the block raises."""
    try:
        yield
    except ps.PSNodeError as exc:
        raise translate(exc) from exc


def maps_runtime_errors(method: _Method) -> _Method:
    """Decorate ``method`` so that it raises kvcore's error for any psnode error (``translate``)."""

    @functools.wraps(method)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except ps.PSNodeError as exc:
            raise translate(exc) from exc

    return mapped  # type: ignore[return-value]
