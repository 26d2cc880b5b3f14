"""A minimal row-sparse value: the rows of a 2-D (or higher) array that are present, and their indices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import arrays

__all__ = ["RowSparseArray"]


@dataclass
class RowSparseArray:
    """Rows ``indices`` of an array of ``shape``; every other row is zero.

    ``data`` has shape ``(len(indices),) + shape[1:]``. ``row_sparse_pull`` fills one in place
    (``indices`` sorted and unique) when it is given as ``out``.
    """

    shape: tuple[int, ...]
    dtype: Any = np.float32
    indices: Any = field(default_factory=lambda: np.zeros((0,), dtype=np.int64))
    data: Any = None

    def __post_init__(self) -> None:
        self.shape = tuple(int(n) for n in self.shape)
        self.dtype = np.dtype(self.dtype)
        if self.data is None:
            self.data = np.zeros((len(self.indices),) + self.shape[1:], dtype=self.dtype)

    def todense(self) -> Any:
        """A dense array of ``shape`` holding the present rows, zeros elsewhere."""
        home = arrays.device_of(self.data)
        dense = arrays.zeros(self.shape, self.dtype, home)
        if len(self.indices):
            with arrays.device_context(home):  # the index and the scatter on data's device
                dense[arrays.to_device(self.indices, home)] = self.data
        return dense
