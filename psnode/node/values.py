"""What a key's value may be, checked where values come from the network or from a file.

The dtypes a key may have are MXNet's KVStore's; shapes and counts come from JSON, where a bool is
an int and any nesting is possible, so each is checked before use. The server's store, the
checkpoint files and kvcore's stores check with these same rules.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["VALUE_DTYPES", "MAX_DIMS", "is_int", "is_shape", "dtype_of"]

VALUE_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", "uint8", "int8", "int32", "int64"))
"""The dtypes a key may have: MXNet's KVStore's (anything else is refused at init)."""

MAX_DIMS = 32


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON's numbers come back as both)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_shape(value: Any) -> bool:
    """True for a shape from the network or a file: a list of at most 32 sizes >= 0."""
    return isinstance(value, list) and len(value) <= MAX_DIMS and all(is_int(n) and n >= 0 for n in value)


def dtype_of(value: Any) -> np.dtype | None:
    """The dtype ``value`` names, or None when it names none."""
    try:
        return np.dtype(value)
    except TypeError:
        return None
