"""What the ``2bit`` and ``1bit`` codecs share: a threshold set once per job, and decoding through
``psnode.compression`` (numpy, on the host).

A worker quantizes with a residual it keeps and pushes the packed words; the server turns them back
into float32 values before the round merges them (arrival order, as MXNet's server sums). The
threshold reaches every server in a ``SET_CODEC`` message (rank 0 sends it when training code calls
``set_gradient_compression``) at full float32 precision: a push that arrives before it is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..compression import check_threshold, compressed_nbytes, dequantize
from ..errors import RequestRefused
from .base import Codec

__all__ = ["QuantizedCodec"]


class QuantizedCodec(Codec):
    """A codec of ``psnode.compression``'s kind ``kind``: float32 values only, one threshold."""

    kind: str

    def __init__(self) -> None:
        self.threshold: np.float32 | None = None

    def configure(self, params: dict[str, Any]) -> None:
        """Take ``{"threshold": t}``: a JSON number that is finite (and greater than 0 for 2bit).

        Raises:
            RequestRefused: a missing or bad threshold (the message names it).
        """
        if "threshold" not in params:
            raise RequestRefused(f"the {self.name} codec needs a threshold, got the parameters {sorted(params)}")
        value = params["threshold"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestRefused(f"the {self.name} codec's threshold must be a number, got {value!r}")
        try:
            self.threshold = check_threshold(self.kind, value)
        except ValueError as exc:
            raise RequestRefused(str(exc)) from None

    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        return compressed_nbytes(count, self.kind)

    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        if dtype != np.float32:
            raise RequestRefused(f"{self.name} pushes carry float32 values, but the key holds {dtype}")
        if self.threshold is None:
            raise RequestRefused(
                f"a {self.name} push arrived before the compression parameters; every worker calls "
                "set_gradient_compression before pushing (rank 0 sends them to the servers)"
            )
        return dequantize(self.kind, data, self.threshold, size=count)
