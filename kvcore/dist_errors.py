"""The edge between the runtime's errors and kvcore's: one table, applied where kvcore calls psnode.

psnode raises its own tree (``psnode.errors``); a user of kvcore sees kvcore's
(``kvcore.errors``). ``translate`` maps one error through ``_TABLE`` (most specific first) and keeps
the psnode error as ``__cause__``; ``runtime_errors()`` applies it around a call into psnode. The
dist stores use nothing else to map errors: calls go through ``runtime_errors``, and the handles
they return translate what the runtime completed them with when it is read.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from psnode import errors as ps

from .errors import DistributedError, DistTimeoutError, NodeDiedError, ServerError, WorkerMismatchError

__all__ = ["translate", "runtime_errors"]

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
