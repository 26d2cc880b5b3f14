"""The ``1bit`` codec: MXNet's master-branch 1bit gradient compression, 32 values per 32-bit word."""

from __future__ import annotations

from .quantized import QuantizedCodec

__all__ = ["OneBitCodec"]


class OneBitCodec(QuantizedCodec):
    """Bits 1 / 0 decode to +1 / -1 (``psnode.compression``); the threshold only matters to the worker."""

    id = 2
    name = "1bit"
    kind = "1bit"
