"""Fusion: many small values summed as one buffer, grouped the same way on every worker.

A model of many small tensors (biases, norms) or a push of a thousand one-float keys would cost one
collective (one round of messages) per value. ``plan`` groups consecutive values of one dtype into
buffers of at most ``limit`` bytes, in the order given, so workers that pass the same values in the
same order (the same keys, the same parameters) form the same groups and tag them alike. A
``FusionBuffer`` copies a group's values into one flat buffer, which one collective sums, and
copies the sums back out; it is kept and reused while its layout stays.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from psnode import devices

__all__ = ["plan", "FusionBuffer", "DEFAULT_LIMIT"]

DEFAULT_LIMIT = 4 << 20


def plan(nbytes: Sequence[int], dtypes: Sequence[Any], limit: int = DEFAULT_LIMIT) -> list[list[int]]:
    """Indices of the values, grouped: consecutive values of one dtype, at most ``limit`` bytes in
    all; a value of ``limit`` bytes or more (or every value when ``limit`` <= 0) is a group alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    kind = None
    for i, (n, dtype) in enumerate(zip(nbytes, dtypes)):
        if type(dtype) is not np.dtype and not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        if limit <= 0 or n >= limit:
            if current:
                groups.append(current)
                current, size = [], 0
            groups.append([i])
            continue
        if current and (dtype != kind or size + n > limit):
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
        kind = dtype
    if current:
        groups.append(current)
    return groups


class FusionBuffer:
    """A flat buffer holding values of ``sizes`` elements of ``dtype`` back to back."""

    def __init__(self, dtype: Any, sizes: Sequence[int]) -> None:
        self.dtype = np.dtype(dtype)
        self.sizes = tuple(int(n) for n in sizes)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist()
        self.buffer = np.empty(self.offsets[-1], self.dtype)
        self._parts = [self.buffer[a:b] for a, b in zip(self.offsets, self.offsets[1:])]  # flat views, made once

    def fits(self, dtype: Any, sizes: Sequence[int]) -> bool:
        """True when this buffer has exactly that layout (so it may be reused)."""
        return self.dtype == np.dtype(dtype) and self.sizes == tuple(int(n) for n in sizes)

    def part(self, i: int) -> np.ndarray:
        """The flat view of value ``i`` in the buffer."""
        return self._parts[i]

    def pack(self, values: Sequence[Any]) -> np.ndarray:
        """Copy ``values`` (arrays of the layout's sizes, any shape; device arrays are downloaded) in;
        the buffer."""
        ndarray = np.ndarray
        hosts = [v if type(v) is ndarray else devices.asnumpy(v) for v in values]
        np.concatenate(hosts, axis=None, out=self.buffer)  # axis=None: each one flattened on the way
        return self.buffer

    def unpack(self, outs: Sequence[Any]) -> None:
        """Copy the buffer's parts out into ``outs`` (arrays of the layout's sizes; device arrays too)."""
        copyto, ndarray = np.copyto, np.ndarray
        for out, part in zip(outs, self._parts):
            if part.shape != out.shape:
                part = part.reshape(out.shape)
            if type(out) is ndarray:
                copyto(out, part)
            else:
                devices.copy_into(out, part)
