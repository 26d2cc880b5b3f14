"""Gradient compression, as MXNet's ``kv.set_gradient_compression(params)`` has it, and beyond.

``params`` is a dict: ``{'type': '2bit', 'threshold': 0.5}``. MXNet's types: ``2bit`` (MXNet 1.9.1's,
bit for bit) and ``1bit`` (MXNet's master branch); ``threshold`` defaults to 0.5; other keys are
ignored, as MXNet ignores them. The threshold is read the way MXNet reads it: ``str(value)`` parsed
into a float32 by MXNet's own parser (dmlc-core's), which for a few values rounds differently from
``numpy.float32(value)``, so a job gets the very threshold, and so the very bits, MXNet would.

The other types (``psnode.compression.schemes``) take only their own keys, and refuse any other,
naming it:

- ``{'type': 'fp16'}``, ``{'type': 'bf16'}``: half width; pulls of float32 keys too (``'pull'``).
- ``{'type': '1bit_scaled', 'block': 0}``: a sign bit per value and a scale per ``block`` values
  (0: one per key part), with error feedback.
- ``{'type': 'topk', 'ratio': 0.01}``, ``{'type': 'randomk', 'ratio': 0.01, 'seed': 0}``: that
  fraction of each part's values with their indices, with error feedback.
- ``'momentum': 0.9`` (the types with error feedback): momentum correction (Deep Gradient
  Compression's): each worker keeps a velocity ``u = momentum * u + g`` per slot and encodes that,
  with its residual; ``topk``/``randomk`` then clear the velocity of the values sent. The optimizer
  that applies the sums must then run without momentum of its own.

Every type also takes ``'pull'``: ``'fp16'``, ``'bf16'`` or ``'float32'``, the width a pull of a
float32 key travels at on a distributed store (the half-width types default to their own, the others
to ``'float32'``); the new types take ``'error_feedback'`` (a bool: on by default for
``1bit_scaled``, ``topk`` and ``randomk``, off for ``fp16``/``bf16``).

Which stores: those whose type names ``device``, ``dist`` or ``allreduce``. Each pushed float32 value is
encoded with a residual kept per *slot* (``(key, list position)`` in the ``device`` store), then decoded
and merged. Calling it again changes the parameters and keeps the residuals (of the same length).

The kernels come from ``psnode.compression`` (the servers use them too) and are re-exported here:
``quantize``, ``dequantize``, ``compressed_words``, ``compressed_nbytes``, ``split_on_words``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from psnode.compression import (
    KINDS as MXNET_KINDS,
    check_threshold,
    compressed_nbytes,
    compressed_words,
    dequantize,
    quantize,
    split_on_words,
    values_per_word,
)
from psnode.compression.schemes import (
    HALF_KINDS,
    NEW_KINDS,
    HalfScheme,
    ScaledSignScheme,
    Scheme,
    SparseScheme,
    ThresholdScheme,
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
DEFAULT_RATIO = 0.01
KINDS = MXNET_KINDS + NEW_KINDS
"""Every compression type: MXNet's ``2bit`` and ``1bit``, then ``fp16``, ``bf16``, ``1bit_scaled``, ``topk``,
``randomk``."""

PULL_WIDTHS = ("float32",) + HALF_KINDS
_OWN_KEYS = {"fp16": (), "bf16": (), "1bit_scaled": ("block", "momentum"), "topk": ("ratio", "momentum"),
             "randomk": ("ratio", "seed", "momentum")}


@dataclass(frozen=True)
class CompressionParams:
    """Checked compression parameters (see the module docstring).

    ``type``; ``threshold`` (float32, MXNet's types); ``ratio`` (``topk``/``randomk``); ``block``
    (``1bit_scaled``); ``seed`` (``randomk``); ``error_feedback``; ``pull``: the codec pulls of
    float32 keys travel in (``'fp16'``/``'bf16'``), or None for full width.
    """

    type: str
    threshold: np.float32 = np.float32(DEFAULT_THRESHOLD)
    ratio: float = DEFAULT_RATIO
    block: int = 0
    seed: int = 0
    error_feedback: bool = True
    pull: str | None = None
    momentum: float = 0.0

    def scheme(self, stream: int = 0) -> Scheme:
        """The ``Scheme`` that encodes and decodes with these parameters (``stream``: a worker's own
        random draws for ``randomk``, mixed into the seed)."""
        if self.type in MXNET_KINDS:
            return ThresholdScheme(self.type, self.threshold)
        if self.type in HALF_KINDS:
            return HalfScheme(self.type, self.error_feedback)
        if self.type == "1bit_scaled":
            return ScaledSignScheme(self.block, self.error_feedback)
        seed = self.seed
        if self.type == "randomk":  # each worker its own draws
            seed = int(np.random.SeedSequence([self.seed, stream]).generate_state(1)[0])
        return SparseScheme(self.type, self.ratio, self.error_feedback, seed)

    @property
    def split_word(self) -> int:
        """Values per word a key split over servers keeps parts on (MXNet's types: whole packed words)."""
        return values_per_word(self.type) if self.type in MXNET_KINDS else 1


def check_store_type(store_type: str) -> None:
    """Raise ``CompressionError`` unless a store of ``store_type`` can compress (device, dist or allreduce)."""
    if "device" not in store_type and "dist" not in store_type and store_type != "allreduce":
        raise CompressionError(
            f"Gradient compression is not supported for this type of kvstore ({store_type!r}); "
            "use 'device', 'allreduce' or a dist_* store"
        )


def parse_params(params: Any) -> CompressionParams:
    """Check ``set_gradient_compression``'s dict; MXNet's types the way MXNet does, in MXNet's order.

    Raises:
        CompressionError: not a dict; a threshold that is not a number; no ``type``; a threshold
            that is not finite, or not greater than 0 (2bit, or a type that is not known); an
            unknown type (``none`` included): "Unknown type for gradient compression X"; for the
            other types, a key they do not take or a value out of its range, naming it.
    """
    if not isinstance(params, dict):
        raise CompressionError(
            f"the gradient compression parameters must be a dict such as {{'type': '2bit', 'threshold': 0.5}}, "
            f"got {type(params).__name__}"
        )
    if str(params.get("type")) in NEW_KINDS:
        return _parse_new(str(params["type"]), params)
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
    return CompressionParams(kind, check_threshold(kind, threshold), pull=_pull_width(params, None))


def _parse_new(kind: str, params: dict) -> CompressionParams:
    """The parameters of a type beyond MXNet's: its own keys only, each checked."""
    allowed = ("type", "error_feedback", "pull") + _OWN_KEYS[kind]
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        raise CompressionError(f"{kind} compression takes {', '.join(repr(k) for k in allowed[1:])}, not "
                               f"{', '.join(repr(k) for k in unknown)}")
    feedback = params.get("error_feedback", kind not in HALF_KINDS)
    if not isinstance(feedback, (bool, np.bool_)):
        raise CompressionError(f"{kind} compression's 'error_feedback' is True or False, got {feedback!r}")
    ratio = params.get("ratio", DEFAULT_RATIO)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise CompressionError(f"{kind} compression's 'ratio' is the fraction of values sent, in (0, 1], got {ratio!r}")
    block = params.get("block", 0)
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 0:
        raise CompressionError(f"1bit_scaled compression's 'block' is a count of values per scale (0: one per key "
                               f"part), got {block!r}")
    seed = params.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise CompressionError(f"randomk compression's 'seed' is an integer of at least 0, got {seed!r}")
    momentum = params.get("momentum", 0.0)
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise CompressionError(f"{kind} compression's 'momentum' is in [0, 1), got {momentum!r}")
    if momentum and not feedback:
        raise CompressionError(f"{kind} compression's 'momentum' needs error feedback (the velocity's unsent part "
                               "stays in the residual); leave 'error_feedback' on")
    return CompressionParams(kind, ratio=float(ratio), block=int(block), seed=int(seed), error_feedback=bool(feedback),
                             pull=_pull_width(params, kind if kind in HALF_KINDS else None), momentum=float(momentum))


def _pull_width(params: dict, default: str | None) -> str | None:
    width = params.get("pull", default or "float32")
    if width not in PULL_WIDTHS:
        raise CompressionError(f"the gradient compression's 'pull' is one of {', '.join(PULL_WIDTHS)}, got {width!r}")
    return None if width == "float32" else width


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
    """A store's compression: its parameters, their scheme, and one residual per slot.

    A slot is whatever the store encodes on its own: ``(key, list position)`` in the ``device``
    store; a distributed store uses ``(key, part)``. A residual starts at zero, lives on the device
    of its slot's values (it follows them when they move) and is kept when the parameters change,
    as in MXNet. Schemes without error feedback keep none. ``stream``: the store's own random draws
    (its rank), for ``randomk``.

    Not thread-safe: a store calls it under its own lock.
    """

    def __init__(self, params: CompressionParams, stream: int = 0) -> None:
        self._stream = stream
        self._params = params
        self._scheme = params.scheme(stream)
        self._residuals: dict[Hashable, Any] = {}
        self._velocities: dict[Hashable, Any] = {}  # momentum correction (``'momentum'``): per slot

    @property
    def params(self) -> CompressionParams:
        """The parameters in force."""
        return self._params

    @property
    def scheme(self) -> Scheme:
        """The scheme of the parameters in force."""
        return self._scheme

    def set_params(self, params: CompressionParams) -> None:
        """Change the parameters; residuals are kept."""
        self._params = params
        self._scheme = params.scheme(self._stream)

    def quantize(self, slot: Hashable, value: Any) -> Any:
        """Encode float32 ``value`` with the residual of ``slot``; return the encoded bytes (on its device).

        Raises:
            TypeError: ``value`` is not float32. ValueError: its size differs from the slot's.
        """
        home = arrays.device_of(value)
        residual = None
        if self._scheme.keeps_residual:
            residual = self._slot_array(self._residuals, slot, value, home)
        momentum = self._params.momentum
        with arrays.device_context(home):
            if not momentum:
                return self._scheme.encode(value, residual)
            velocity = self._slot_array(self._velocities, slot, value, home)
            velocity *= np.float32(momentum)
            velocity += value.reshape(-1)
            encoded = self._scheme.encode(velocity, residual)
            sent = self._scheme.sent_indices(encoded)
            if sent is not None:  # momentum factor masking: what was sent starts its velocity afresh
                velocity[sent] = 0
            return encoded

    @staticmethod
    def _slot_array(arrays_of: dict, slot: Hashable, value: Any, home: Any) -> Any:
        """The float32 array ``arrays_of[slot]`` as long as ``value``, on its device (zeros at first)."""
        held = arrays_of.get(slot)
        if held is None:
            held = arrays_of[slot] = arrays.zeros(int(value.size), np.float32, home)
        elif arrays.device_of(held) != home:
            held = arrays_of[slot] = arrays.to_device(held, home)
        return held

    def dequantize(self, packed: Any, out: Any, accumulate: bool = False) -> Any:
        """Decode ``packed`` into float32 ``out`` (or add it to ``out``); returns ``out``."""
        with arrays.device_context(arrays.device_of(out)):
            return self._scheme.decode(packed, out, accumulate=accumulate)
