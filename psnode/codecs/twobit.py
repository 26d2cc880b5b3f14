"""The ``2bit`` codec: MXNet 1.9.1's 2bit gradient compression, 16 values per 32-bit word."""

from __future__ import annotations

from .quantized import QuantizedCodec

__all__ = ["TwoBitCodec"]


class TwoBitCodec(QuantizedCodec):
    """Codes ``11`` / ``10`` / ``00`` decode to ``+t`` / ``-t`` / 0 (``psnode.compression``)."""

    id = 1
    name = "2bit"
    kind = "2bit"
