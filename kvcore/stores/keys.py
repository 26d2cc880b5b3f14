"""Normalising the many call forms of the KVStore API into one: a list of ``(key, [arrays])``.

MXNet's API accepts a key or a list of keys; for each key one array or a list of arrays (one per
device). Every store method first turns its arguments into ``[(key, [array, ...]), ...]`` here, so
the stores themselves deal with a single form.
"""

from __future__ import annotations

import numbers
from typing import Any, Hashable, Sequence

import numpy as np

from .. import arrays
from ..errors import KeyTypeError, ValueCountError

__all__ = ["KeyKind", "group", "is_key_list"]


def is_key_list(key: Any) -> bool:
    """True when ``key`` is a list or tuple of keys rather than one key."""
    return isinstance(key, (list, tuple))


class KeyKind:
    """Remembers whether a store uses int or str keys, and rejects the other kind.

    Keys are normalised: numpy integers become ``int``. Booleans are rejected (they are ints in
    Python, but never a sensible key).
    """

    def __init__(self) -> None:
        self.kind: type | None = None

    def check(self, key: Any) -> Hashable:
        """Return the normalised key, fixing the store's key kind on first use.

        Raises:
            KeyTypeError: ``key`` is neither int nor str, or is of the other kind than earlier keys.
        """
        kind = type(key)
        if kind is self.kind:  # the common case, checked first: keys lists can be long
            return key
        if isinstance(key, bool) or not isinstance(key, (numbers.Integral, str)):
            raise KeyTypeError(f"a key must be an int or a str, got {key!r} ({type(key).__name__})")
        norm: Hashable = key if isinstance(key, str) else int(key)
        kind = type(norm)
        if self.kind is None:
            self.kind = kind
        elif kind is not self.kind:
            raise KeyTypeError(
                f"this store uses {self.kind.__name__} keys, so key {key!r} "
                f"({kind.__name__}) cannot be used; one store never mixes int and str keys"
            )
        return norm


def _as_list(value: Any, what: str, key: Any) -> list[Any]:
    if type(value) is np.ndarray:  # the common case first: key lists can be long
        return [value]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueCountError(f"an empty list of {what}s was given for key {key!r}")
        items = list(value)
    else:
        items = [value]
    for item in items:
        if not arrays.is_array(item) and not _is_row_sparse(item):
            raise TypeError(
                f"{what} for key {key!r} must be a numpy or CuPy array, got {type(item).__name__}"
            )
    return items


def _is_row_sparse(value: Any) -> bool:
    from ..sparse import RowSparseArray  # local import: sparse imports nothing of ours but arrays

    return isinstance(value, RowSparseArray)


def group(key: Any, values: Any, what: str, kinds: KeyKind) -> list[tuple[Hashable, list[Any]]]:
    """Turn ``(key, values)`` in any accepted form into ``[(key, [array, ...]), ...]``.

    ``what`` names the values in error messages (``value``, ``out``).

    Raises:
        KeyTypeError: a key of the wrong type or kind.
        ValueCountError: a list of keys with a list of values of another length.
        TypeError: a value that is not an array.
    """
    if is_key_list(key):
        keys: Sequence[Any] = key
        if not isinstance(values, (list, tuple)):
            raise ValueCountError(
                f"{len(keys)} keys {list(keys)!r} were given with a single {what}; "
                f"give a list of {len(keys)} {what}s"
            )
        if len(values) != len(keys):
            raise ValueCountError(
                f"{len(keys)} keys {list(keys)!r} were given with {len(values)} {what}s"
            )
        check, kind, ndarray = kinds.check, kinds.kind, np.ndarray
        # a key of the store's kind with one host array is taken as it is (key lists can be long)
        return [(k if type(k) is kind else check(k), [v] if type(v) is ndarray else _as_list(v, what, k))
                for k, v in zip(keys, values)]
    return [(kinds.check(key), _as_list(values, what, key))]
