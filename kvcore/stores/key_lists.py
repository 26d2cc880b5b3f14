"""Key lists a distributed store is handed again and again: resolved once, then matched whole.

A training loop pushes and pulls the same list of keys every step (a model's parameters), each with a
host array of the key's shape and dtype. The general path groups, checks and slices every key of
every call; ``KeyListPlans`` keeps what a list of initialised, unsplit keys resolves to (each key's
server and key id, its shape and dtype) and checks a later call against it with no Python step per
key (``map`` over the arrays, comparisons of whole lists). A call that does not match in every
respect (another key, a key of another type, an array of another shape, dtype or type, an out that is
not a writable C-contiguous array) gets None and takes the general path, which names what is wrong.

The plans stay valid while the keys' layouts do; the store forgets them all whenever layouts are
taken (``forget``). At most ``LIMIT`` lists are kept.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

__all__ = ["KeyListPlans"]

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")
_WRITEABLE = operator.attrgetter("flags.writeable")
_KEY_TYPES = (int, str)  # a store's key kinds; others (a float equal to an int key) take the general path
_ONE_ARRAY = {np.ndarray}


@dataclass(frozen=True)
class _Plan:
    key_types: set  # the type of every key (one of _KEY_TYPES): a list of equal keys of another type does not match
    servers: tuple[int, ...]
    ids: tuple[int, ...]
    shapes: list[tuple[int, ...]]
    dtypes: list[np.dtype]


class KeyListPlans:
    """The plans of the key lists a store was handed (see the module docstring). ``whole`` (key ->
    (server, key id) of each unsplit key) and ``meta`` (key -> its ``KeyMeta``) are the store's own,
    read when a list is first seen."""

    LIMIT = 16

    def __init__(self, whole: dict[Hashable, tuple[int, int]], meta: dict[Hashable, Any]) -> None:
        self._whole = whole
        self._meta = meta
        self._plans: dict[tuple, _Plan | None] = {}

    def forget(self) -> None:
        """Layouts changed: resolve every list again."""
        self._plans = {}

    def parts(self, keys: Any, arrays: Any, writable: bool = False) -> list[tuple[int, int, np.ndarray]] | None:
        """``[(server, key id, array), ...]`` for a list of keys and a list of as many host arrays
        (``writable``: outs, which must also be writable and C-contiguous), when the keys are
        initialised and unsplit and every array is a numpy array of its key's shape and dtype; else
        None (the general path decides)."""
        if type(keys) not in (list, tuple) or type(arrays) not in (list, tuple) or len(keys) != len(arrays):
            return None
        try:
            name = tuple(keys)
            plan = self._plans.get(name, False)
        except TypeError:  # an unhashable key: the general path names it
            return None
        if plan is False:
            plan = self._resolve(name)
        if (plan is None or set(map(type, keys)) != plan.key_types or set(map(type, arrays)) != _ONE_ARRAY
                or list(map(_SHAPE, arrays)) != plan.shapes or list(map(_DTYPE, arrays)) != plan.dtypes):
            return None
        if writable and not (all(map(_C_CONTIGUOUS, arrays)) and all(map(_WRITEABLE, arrays))):
            return None
        return list(zip(plan.servers, plan.ids, arrays))

    def _resolve(self, keys: tuple) -> _Plan | None:
        """The plan of ``keys`` (None: a key not initialised, split, repeated or of another type), kept
        unless its keys are of another type: equal keys of the store's type (``1.0 == 1``) may follow."""
        key_types = set(map(type, keys))
        if len(key_types) != 1 or not key_types <= set(_KEY_TYPES):
            return None
        if len(self._plans) >= self.LIMIT:
            self._plans = {}
        plan = None
        targets = [self._whole.get(key) for key in keys]
        metas = [self._meta.get(key) for key in keys]
        if len(set(keys)) == len(keys) and None not in targets and None not in metas:
            plan = _Plan(key_types, tuple(t[0] for t in targets), tuple(t[1] for t in targets),
                         [m.shape for m in metas], [m.dtype for m in metas])
        self._plans[keys] = plan
        return plan
