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
import sys
from typing import Any, Callable, Iterator, TypeVar

from psnode import errors as ps

from .errors import DistributedError, DistTimeoutError, EnvContractError, NodeDiedError, ServerError, WorkerMismatchError

__all__ = ["translate", "runtime_errors", "maps_runtime_errors"]

_Method = TypeVar("_Method", bound=Callable[..., Any])

_TABLE: tuple[tuple[type[BaseException], Callable[[BaseException], BaseException]], ...] = (
    (ps.EnvError, lambda e: EnvContractError(str(e))),
    (ps.PeerDiedError, lambda e: NodeDiedError(str(e), e.role, e.rank, e.host)),
    (ps.RemoteError, lambda e: ServerError(str(e))),
    (ps.MismatchError, lambda e: WorkerMismatchError(str(e))),
    (ps.NodeTimeoutError, lambda e: DistTimeoutError(str(e))),
    (ps.PSNodeError, lambda e: DistributedError(str(e))),
)


def translate(exc: BaseException) -> BaseException:
    """The kvcore error for a psnode error, with it as ``__cause__``; any other error as it is. An
    ``EnvContractError`` that nobody catches ends the process with its one line (``_one_line``)."""
    for kind, make in _TABLE:
        if isinstance(exc, kind):
            new = make(exc)
            new.__cause__ = exc
            if isinstance(new, EnvContractError):
                _one_line_when_uncaught()
            return new
    return exc


def _one_line_when_uncaught() -> None:
    """Have an uncaught ``EnvContractError`` print ``kvcore: error: <message>`` instead of a traceback
    (once installed, any other exception goes to the hook that was there before)."""
    if getattr(sys.excepthook, "_kvcore_one_line", False):
        return
    before = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if isinstance(value, EnvContractError):
            where = "" if "docs/env.md" in str(value) else " (docs/env.md)"
            print(f"kvcore: error: {value}{where}", file=sys.stderr, flush=True)
            return
        before(kind, value, tb)

    hook._kvcore_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook


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
