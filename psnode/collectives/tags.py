"""What names a collective on every worker: key ids, labels for messages, value descriptions.

A key (a str, int, bytes or a tuple of those) becomes a 64-bit id, the same in every process (a
hash, kept for keys seen before); with a version it is the tag messages carry. ``describe`` gives
an array's ``wire.Desc`` (dtype, shape and what follows), kept per (dtype, shape): both sit on every
collective's hot path. ``Label`` writes ``allreduce of key 'w'`` only when an error or a warning
needs it. ``error_flags`` and ``told_error`` carry an error's class in an ``ERROR`` message.
"""

from __future__ import annotations

import hashlib
from typing import Any

from psnode.errors import MismatchError, ProtocolError, PSNodeError

from .wire import Desc

__all__ = ["key_id_of", "Label", "describe", "error_flags", "told_error"]

_KEY_IDS: dict[Any, int] = {}
_KEY_IDS_MAX = 100_000  # ids kept for keys seen before (a hash is a few microseconds)


def key_id_of(key: Any) -> int:
    """A 64-bit id of ``key`` (str, int, bytes or a tuple of those), the same in every process."""
    key_id = _KEY_IDS.get(key)
    if key_id is None or type(key) is bool:
        digest = hashlib.blake2b(repr(_canonical(key)).encode(), digest_size=8).digest()
        key_id = int.from_bytes(digest, "little")
        if len(_KEY_IDS) < _KEY_IDS_MAX:
            _KEY_IDS[key] = key_id
    return key_id


def _canonical(key: Any) -> Any:
    if isinstance(key, (str, int, bytes)):
        return (type(key).__name__, key)
    if isinstance(key, tuple):
        return tuple(_canonical(k) for k in key)
    raise TypeError(f"a collective's key is a str, int, bytes or a tuple of those, not {type(key).__name__}")


_KEY_TEXT = 300  # characters of a key an error or warning shows at most
_TUPLE_ITEMS = 6  # items of a tuple key shown before "... N in all"


class Label:
    """``allreduce of key 'w'``, written only when an error or a warning needs it."""

    __slots__ = ("what", "key")

    def __init__(self, what: str, key: Any) -> None:
        self.what = what
        self.key = key

    def __str__(self) -> str:
        return f"{self.what} of key {_short(self.key)}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def _short(key: Any, room: int = _KEY_TEXT) -> str:
    """``repr(key)``, with long tuples cut to their first items and a count (a fused push names its
    thousand keys), and any text cut at ``room`` characters: a message names a key, it does not list one."""
    if isinstance(key, tuple) and len(key) > _TUPLE_ITEMS:
        shown = ", ".join(_short(k, room) for k in key[:_TUPLE_ITEMS - 1])
        text = f"({shown}, ... {len(key)} in all)"
    elif isinstance(key, tuple):
        text = "(" + ", ".join(_short(k, room) for k in key) + ("," if len(key) == 1 else "") + ")"
    else:
        text = repr(key)
    return text if len(text) <= room else text[:room - 3] + "..."


_DESCS: dict[tuple[Any, tuple[int, ...]], Desc] = {}


def describe(array: Any) -> Desc:
    """``array``'s ``Desc`` (kept for shapes seen before: a collective's hot path).

    Raises:
        TypeError: a dtype collectives do not sum.
    """
    slot = (array.dtype, array.shape)
    desc = _DESCS.get(slot)
    if desc is None:
        desc = Desc(array.dtype, array.shape)
        if len(_DESCS) < 10_000:
            _DESCS[slot] = desc
    return desc


_FLAG_MISMATCH = 1  # an ERROR's flags: the op failed because workers disagree on shape or dtype,
_FLAG_PROTOCOL = 2  # or because a worker sent a malformed message


def error_flags(error: BaseException) -> int:
    """The flags of an ``ERROR`` message that tells ``error``."""
    return _FLAG_MISMATCH if isinstance(error, MismatchError) else _FLAG_PROTOCOL if isinstance(error, ProtocolError) else 0


def told_error(text: str, flags: int) -> PSNodeError:
    """The error an ``ERROR`` message tells, of the class its flags name."""
    if flags & _FLAG_MISMATCH:
        return MismatchError(text)
    if flags & _FLAG_PROTOCOL:
        return ProtocolError(text)
    return PSNodeError(text)
