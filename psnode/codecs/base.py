"""The interface every codec implements (see ``psnode.codecs``)."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

__all__ = ["Codec"]


class Codec(abc.ABC):
    """One way of encoding a pushed value: a wire id, a name, and how to decode it.

    Encoding happens where the value and its residuals live (the worker, in kvcore); a server only
    decodes.
    """

    id: int
    name: str

    def configure(self, params: dict[str, Any]) -> None:
        """Take the job's parameters for this codec (none by default).

        Raises:
            RequestRefused: parameters this codec cannot use.
        """

    @abc.abstractmethod
    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        """The bytes the encoding of ``count`` values of ``dtype`` takes on the wire."""

    @abc.abstractmethod
    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        """The ``count`` values ``data`` encodes (``data`` is ``encoded_nbytes(count, dtype)`` long)."""
