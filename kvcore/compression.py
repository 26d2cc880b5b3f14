"""Gradient compression, as MXNet's ``kv.set_gradient_compression(params)`` has it.

``params`` is a dict: ``{'type': '2bit', 'threshold': 0.5}``. ``type`` is ``2bit`` (MXNet 1.9.1's,
bit for bit) or ``1bit`` (MXNet's master branch); ``threshold`` defaults to 0.5; other keys are
ignored. The threshold is read the way MXNet reads it: ``str(value)`` parsed into a float32 by
MXNet's own parser (dmlc-core's), which for a few values rounds differently from
``numpy.float32(value)``, so a job gets the very threshold, and so the very bits, MXNet would.

Which stores: those whose type names ``device`` or ``dist``. Each pushed float32 value is quantized
with a residual kept per *slot* (``(key, list position)`` in the ``device`` store), then dequantized
and merged. Calling it again changes the parameters and keeps the residuals.

The kernels come from ``psnode.compression`` (the servers use them too) and are re-exported here:
``quantize``, ``dequantize``, ``compressed_words``, ``compressed_nbytes``, ``split_on_words``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from psnode.compression import (
    KINDS,
    check_threshold,
    compressed_nbytes,
    compressed_words,
    dequantize,
    quantize,
    split_on_words,
    values_per_word,
)

from . import arrays
from .errors import CompressionError

__all__ = [
    "KINDS",
    "CompressionParams",
    "GradientCompression",
    "parse_params",
    "parse_threshold",
    "check_store_type",
    "quantize",
    "dequantize",
    "compressed_words",
    "compressed_nbytes",
    "split_on_words",
    "values_per_word",
    "check_threshold",
]

DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class CompressionParams:
    """Checked compression parameters: ``type`` (``'2bit'`` or ``'1bit'``) and the float32 ``threshold``."""

    type: str
    threshold: np.float32


def check_store_type(store_type: str) -> None:
    """Raise ``CompressionError`` unless a store of ``store_type`` can compress (its name has device or dist)."""
    if "device" not in store_type and "dist" not in store_type:
        raise CompressionError(
            f"Gradient compression is not supported for this type of kvstore ({store_type!r}); "
            "use 'device' or a dist_* store"
        )


def parse_params(params: Any) -> CompressionParams:
    """Check ``set_gradient_compression``'s dict the way MXNet does, in MXNet's order.

    Raises:
        CompressionError: not a dict; a threshold that is not a number; no ``type``; a threshold
            that is not finite, or not greater than 0 (2bit, or a type that is not known); an
            unknown type (``none`` included): "Unknown type for gradient compression X".
    """
    if not isinstance(params, dict):
        raise CompressionError(
            f"the gradient compression parameters must be a dict such as {{'type': '2bit', 'threshold': 0.5}}, "
            f"got {type(params).__name__}"
        )
    threshold = parse_threshold(params["threshold"]) if "threshold" in params else np.float32(DEFAULT_THRESHOLD)
    if "type" not in params:
        raise CompressionError(
            f"the gradient compression parameters have no 'type' (got {sorted(map(str, params))}); "
            f"give one of {', '.join(KINDS)}"
        )
    kind = str(params["type"])
    if not np.isfinite(threshold):
        raise CompressionError(f"the gradient compression threshold must be a finite number, got {params['threshold']!r}")
    if kind != "1bit" and not threshold > 0:  # MXNet checks this before it looks at the type
        raise CompressionError(
            f"the gradient compression threshold must be greater than 0, got {params.get('threshold')!r}"
        )
    if kind not in KINDS:
        raise CompressionError(f"Unknown type for gradient compression {kind} (known types: {', '.join(KINDS)})")
    return CompressionParams(kind, check_threshold(kind, threshold))


# dmlc-core's float grammar: leading blanks, a sign, digits, a point, digits, an exponent, an 'f'.
_NUMBER = re.compile(
    r"[ \t\r\n\f]*(?P<sign>[+-]?)(?:(?P<special>inf(?:inity)?|nan)"
    r"|(?P<int>\d*)(?:\.(?P<frac>\d*))?(?:[eE](?P<esign>[+-]?)(?P<exp>\d*))?)[fF]?",
    re.IGNORECASE,
)
_F32 = np.float32


def parse_threshold(value: Any) -> np.float32:
    """The float32 MXNet makes of ``value``: ``str(value)`` through dmlc-core's ``stof``.

    That parser adds the integer and fraction parts in float32 and scales by powers of ten in
    float32, so ``'7.374512500957097e-06'`` becomes a float32 one step away from
    ``numpy.float32(7.374512500957097e-06)``. Following it keeps thresholds, and so results,
    identical to MXNet's.

    Raises:
        CompressionError: ``str(value)`` is not a number (naming it), or is out of float32's range.
    """
    text = str(value)
    match = _NUMBER.fullmatch(text)
    if isinstance(value, bool) or match is None or not (match["special"] or match["int"] or match["frac"]):
        raise CompressionError(f"the gradient compression threshold must be a number, got {value!r}")
    negative = match["sign"] == "-"
    if match["special"]:
        result = _F32(np.nan) if match["special"].lower() == "nan" else _F32(np.inf)
        return _F32(-result) if negative else result
    result = np.array(int(match["int"] or "0") % (1 << 64), np.uint64).astype(np.float32)[()]
    if match["frac"] is not None:
        digits = match["frac"][:19]  # dmlc reads 19 digits after the point and ignores the rest
        result = _F32(result + _F32(float(int(digits or "0")) / float(10 ** len(digits))))
    if match["exp"] is not None:
        exponent = int(match["exp"] or "0")
        shrink = match["esign"] == "-"
        if exponent > 38 or (
            exponent == 38 and ((not shrink and result > _F32(3.402823466)) or (shrink and result < _F32(1.175494351)))
        ):
            raise CompressionError(f"the gradient compression threshold {value!r} is out of float32's range")
        scale = _F32(1.0)
        while exponent >= 8:
            scale, exponent = _F32(scale * _F32(1e8)), exponent - 8
        while exponent > 0:
            scale, exponent = _F32(scale * _F32(10.0)), exponent - 1
        result = _F32(result / scale) if shrink else _F32(result * scale)
    return _F32(-result) if negative else result


class GradientCompression:
    """A store's compression: its parameters and one residual per slot.

    A slot is whatever the store quantizes on its own: ``(key, list position)`` in the ``device``
    store; a distributed store uses ``(key, part)``. A residual starts at zero, lives on the device
    of its slot's values (it follows them when they move) and is kept when the parameters change,
    as in MXNet.

    Not thread-safe: a store calls it under its own lock.
    """

    def __init__(self, params: CompressionParams) -> None:
        self._params = params
        self._residuals: dict[Hashable, Any] = {}

    @property
    def params(self) -> CompressionParams:
        """The parameters in force."""
        return self._params

    def set_params(self, params: CompressionParams) -> None:
        """Change the parameters; residuals are kept."""
        self._params = params

    def quantize(self, slot: Hashable, value: Any, out: Any = None) -> Any:
        """Quantize float32 ``value`` with the residual of ``slot``; return the packed bytes (on its device).

        Raises:
            TypeError: ``value`` is not float32. ValueError: its size differs from the slot's.
        """
        residual = self._residuals.get(slot)
        home = arrays.device_of(value)
        if residual is None:
            residual = self._residuals[slot] = arrays.zeros(int(value.size), np.float32, home)
        elif arrays.device_of(residual) != home:
            residual = self._residuals[slot] = arrays.to_device(residual, home)
        with arrays.device_context(home):
            return quantize(self._params.type, value, residual, self._params.threshold, out)

    def dequantize(self, packed: Any, out: Any, accumulate: bool = False) -> Any:
        """Unpack ``packed`` into float32 ``out`` (or add it to ``out``); returns ``out``."""
        with arrays.device_context(arrays.device_of(out)):
            return dequantize(self._params.type, packed, self._params.threshold, out, accumulate=accumulate)
