"""The ``raw`` codec: a value travels as its own bytes."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Codec

__all__ = ["RawCodec"]


class RawCodec(Codec):
    """The value's in-memory bytes; decoding is a view of the message, nothing is copied."""

    id = 0
    name = "raw"

    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        return count * dtype.itemsize

    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(data, dtype=dtype, count=count)
