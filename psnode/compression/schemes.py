"""Compression schemes: how a worker encodes a gradient (with its residual) and how anyone decodes it.

One class per ``set_gradient_compression`` type, all with the same face (``Scheme``): ``encode``
a float32 value, updating the slot's residual where the scheme keeps one (error feedback: what the
encoding did not carry is added to the next value), ``decode`` the bytes back (written into an
array, or added to it: a merge of one more push), and ``encoded_nbytes`` (the wire size, a function
of the value count alone, so a server checks a push's length before it decodes it).

=============  ====================================================  ======================  ========
type           encoding of ``n`` float32 values                      bytes                   residual
=============  ====================================================  ======================  ========
``2bit``       MXNet 1.9.1's codes (``psnode.compression``)          ``4 ceil(n/16)``        always
``1bit``       MXNet master's bits (``psnode.compression``)          ``4 ceil(n/32)``        always
``fp16``       IEEE half precision, rounded to nearest even          ``2n``                  opt-in
``bf16``       bfloat16: float32's top 16 bits, rounded to nearest   ``2n``                  opt-in
               even (NaN stays NaN), the bits torch makes
``1bit_scaled`` a sign bit per value and one float32 scale per block  ``4 blocks + ceil(n/8)`` default
               (the block's mean absolute value); decodes to +-scale
``topk``       the ``k = ceil(ratio n)`` values largest in magnitude: ``8k``                    default
               their uint32 indices (ascending), then the values
``randomk``    ``k`` values at indices drawn at random (no repeats),  ``8k``                    default
               laid out as ``topk``
=============  ====================================================  ======================  ========

Error feedback (the default of the three lossy-by-design schemes, BytePS's and 1-bit SGD's ``vanilla``
kind): the value encoded is ``c = g + r`` and the residual becomes ``c - decode(encode(c))``.

Kernels are written once against the array module of their arguments (``numpy``, or CuPy for an
array on a GPU: ``psnode.devices.array_module``), so the CuPy path is the numpy code run on a GPU
and is tested on machines without one through the numpy fallback. The numpy path is the servers':
they decode on the host. Bytes are little-endian; packed data may be any buffer (a received frame),
read without a copy. Every decode checks what it reads: data may come from the network.
"""

from __future__ import annotations

import abc
import math
import threading
from typing import Any

import numpy as np

from psnode import devices
from psnode.compression import check_threshold, compressed_nbytes, dequantize, quantize

__all__ = ["Scheme", "ThresholdScheme", "HalfScheme", "ScaledSignScheme", "SparseScheme", "NEW_KINDS", "HALF_KINDS",
           "to_half", "from_half"]

HALF_KINDS = ("fp16", "bf16")
NEW_KINDS = ("fp16", "bf16", "1bit_scaled", "topk", "randomk")
"""The types beside MXNet's ``2bit`` and ``1bit``."""

_MAX_INDEXED = 1 << 32  # topk / randomk indices are uint32: a part of more values cannot be encoded


class Scheme(abc.ABC):
    """One compression type with its parameters: encode with a residual, decode, the wire size.

    ``name`` is the type (and the name of the servers' codec, ``psnode.compression.codecs``);
    ``keeps_residual``: ``encode`` needs a residual (a float32 array as long as the value, where
    it lives, updated in place). Not thread-safe (``randomk`` draws from one generator): a store
    encodes under its own lock.
    """

    name: str
    keeps_residual: bool = True

    @abc.abstractmethod
    def encoded_nbytes(self, count: int) -> int:
        """The bytes ``count`` encoded values take."""

    @abc.abstractmethod
    def encode(self, grad: Any, residual: Any = None) -> Any:
        """The bytes (a uint8 array where ``grad`` lives) that encode float32 ``grad`` (with the residual)."""

    @abc.abstractmethod
    def decode(self, data: Any, out: Any = None, size: int | None = None, accumulate: bool = False) -> Any:
        """The values ``data`` encodes, written into float32 ``out`` (added to it with ``accumulate``),
        or into a new array of ``size`` values; returns it.

        Raises:
            ValueError: ``data`` is not ``encoded_nbytes`` long, or holds what no encoding makes
                (an index past the end), naming the values.
        """

    def wire_params(self) -> dict[str, Any]:
        """What the servers' codec of this type is configured with (``SET_CODEC``)."""
        return {}

    def sent_indices(self, data: Any) -> Any:
        """The indices of the values an encoding carries, or None when it carries every value."""
        return None

    # ---- shared steps ------------------------------------------------------------------------
    def _target(self, data: Any, out: Any, size: int | None) -> tuple[Any, Any, int]:
        """``(flat uint8 data, flat float32 out or None, value count)``, length checked."""
        data = _as_bytes(data)
        if (out is None) == (size is None):
            raise ValueError("decode needs exactly one of out= (the array to fill) and size= (the value count)")
        n = int(size) if out is None else int(out.size)
        if out is not None:
            if np.dtype(out.dtype) != np.float32 or not out.flags.c_contiguous:
                raise TypeError(f"a {self.name} value decodes into a C-contiguous float32 array, got "
                                f"{np.dtype(out.dtype)}")
            out = out.reshape(-1)
        expected = self.encoded_nbytes(n)
        if int(data.size) != expected:
            raise ValueError(f"{self.name} data for {n} values is {expected} bytes, but {data.size} bytes were given")
        return data, out, n


class ThresholdScheme(Scheme):
    """MXNet's ``2bit`` and ``1bit`` with their threshold: the kernels of ``psnode.compression``."""

    def __init__(self, kind: str, threshold: Any) -> None:
        self.threshold = check_threshold(kind, threshold)
        self.name = kind

    def encoded_nbytes(self, count: int) -> int:
        return compressed_nbytes(count, self.name)

    def encode(self, grad: Any, residual: Any = None) -> Any:
        return quantize(self.name, grad, residual, self.threshold)

    def decode(self, data: Any, out: Any = None, size: int | None = None, accumulate: bool = False) -> Any:
        return dequantize(self.name, data, self.threshold, out, size, accumulate)

    def wire_params(self) -> dict[str, Any]:
        return {"threshold": float(self.threshold)}


def _as_bytes(data: Any) -> Any:
    """``data`` as a flat uint8 array where it lives: a numpy/CuPy uint8 array, or any buffer (no copy)."""
    if devices.is_array(data):
        if np.dtype(data.dtype) != np.uint8 or not data.flags.c_contiguous:
            raise TypeError(f"encoded data must be C-contiguous uint8 bytes, got {np.dtype(data.dtype)}")
        return data.reshape(-1)
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except TypeError as exc:
        raise TypeError(f"encoded data must be a uint8 array or a bytes-like buffer, got {type(data).__name__}") from exc


def _check_value(name: str, grad: Any, residual: Any, needed: bool) -> tuple[Any, Any, Any]:
    """``(array module, flat grad, flat residual or None)``, checked."""
    if np.dtype(grad.dtype) != np.float32:
        raise TypeError(f"{name} compression encodes float32 values, got {np.dtype(grad.dtype)}")
    xp = devices.array_module(grad)
    flat = xp.ascontiguousarray(grad).reshape(-1)
    if not needed:
        return xp, flat, None
    if residual is None:
        raise ValueError(f"{name} compression with error feedback needs a residual")
    if np.dtype(residual.dtype) != np.float32 or int(residual.size) != int(flat.size) or not residual.flags.c_contiguous:
        raise ValueError(f"the residual must be a C-contiguous float32 array of {flat.size} values, got "
                         f"{np.dtype(residual.dtype)} of {residual.size}")
    if devices.array_module(residual) is not xp:
        raise TypeError("the gradient and its residual must live on one device")
    return xp, flat, residual.reshape(-1)


def _with_residual(xp: Any, flat: Any, residual: Any) -> Any:
    """The value to encode: ``grad + residual`` kept in the residual (error feedback), else ``grad``."""
    if residual is None:
        return flat
    xp.add(residual, flat, out=residual)
    return residual


def _store(out: Any, values: Any, accumulate: bool) -> None:
    if accumulate:
        out += values
    else:
        out[...] = values


# ---- fp16 / bf16 ----------------------------------------------------------------------------------
_BF16_ROUND = np.uint32(0x7FFF)
_BF16_QUIET = np.uint32(0x40)


def to_half(kind: str, values: Any) -> Any:
    """Flat float32 ``values`` as uint16 half-width bits (``fp16`` or ``bf16``), rounded to nearest even."""
    xp = devices.array_module(values)
    if kind == "fp16":
        with np.errstate(over="ignore"):  # past 65504: inf, as IEEE half precision has it
            return values.astype(xp.float16).view(xp.uint16)
    bits = values.view(xp.uint32)
    # round to nearest even on the 16 bits dropped; a NaN keeps its sign and becomes a quiet NaN
    rounded = (bits + (_BF16_ROUND + ((bits >> 16) & np.uint32(1)))) >> 16
    nan = values != values
    if bool(nan.any()):
        rounded = xp.where(nan, (bits >> 16) | _BF16_QUIET, rounded)
    return rounded.astype(xp.uint16)


def from_half(kind: str, bits: Any) -> Any:
    """uint16 half-width bits as float32 values (exact: every half value is a float32)."""
    xp = devices.array_module(bits)
    if kind == "fp16":
        return bits.view(xp.float16).astype(xp.float32)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


class HalfScheme(Scheme):
    """``fp16`` / ``bf16``: each value at half width (see the module docstring); error feedback opt-in."""

    def __init__(self, kind: str, error_feedback: bool = False) -> None:
        if kind not in HALF_KINDS:
            raise ValueError(f"a half-width scheme is one of {HALF_KINDS}, got {kind!r}")
        self.name = kind
        self.keeps_residual = bool(error_feedback)

    def encoded_nbytes(self, count: int) -> int:
        return 2 * int(count)

    def encode(self, grad: Any, residual: Any = None) -> Any:
        xp, flat, residual = _check_value(self.name, grad, residual, self.keeps_residual)
        value = _with_residual(xp, flat, residual)
        half = to_half(self.name, value)
        if residual is not None:
            residual -= from_half(self.name, half)
        return half.view(xp.uint8)

    def decode(self, data: Any, out: Any = None, size: int | None = None, accumulate: bool = False) -> Any:
        data, flat, n = self._target(data, out, size)
        xp = devices.array_module(data)
        values = from_half(self.name, data.view(xp.uint16))
        if out is None:
            return values
        _store(flat, values, accumulate)
        return out


# ---- scaled 1-bit -----------------------------------------------------------------------------------
class ScaledSignScheme(Scheme):
    """``1bit_scaled``: a sign bit per value, one scale per ``block`` values (0: one for the value).

    The scale is the block's mean absolute value (of ``grad + residual`` with error feedback), the
    scale that leaves the least squared error for those signs; zero decodes as ``+scale``.
    """

    name = "1bit_scaled"

    def __init__(self, block: int = 0, error_feedback: bool = True) -> None:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 0:
            raise ValueError(f"1bit_scaled's block is a count of values (0: one scale per part), got {block!r}")
        self.block = int(block)
        self.keeps_residual = bool(error_feedback)

    def blocks(self, count: int) -> int:
        """Scales in the encoding of ``count`` values."""
        if count == 0:
            return 0
        return 1 if self.block == 0 else -(-int(count) // self.block)

    def encoded_nbytes(self, count: int) -> int:
        return 4 * self.blocks(count) + -(-int(count) // 8)

    def wire_params(self) -> dict[str, Any]:
        return {"block": self.block}

    def _per_value(self, xp: Any, scales: Any, n: int) -> Any:
        """Each value's scale: ``scales`` repeated over the blocks (the last may be short)."""
        if self.block == 0 or self.block >= n:
            return scales[0]
        return xp.repeat(scales, self.block)[:n]

    def encode(self, grad: Any, residual: Any = None) -> Any:
        xp, flat, residual = _check_value(self.name, grad, residual, self.keeps_residual)
        value = _with_residual(xp, flat, residual)
        n = int(value.size)
        nblocks = self.blocks(n)
        out = xp.empty(self.encoded_nbytes(n), xp.uint8)
        if n == 0:
            return out
        magnitude = xp.abs(value)
        if nblocks == 1:
            scales = magnitude.mean(dtype=xp.float32).reshape(1)
        else:
            full = n // self.block
            scales = xp.empty(nblocks, xp.float32)
            scales[:full] = magnitude[:full * self.block].reshape(full, self.block).mean(axis=1, dtype=xp.float32)
            if nblocks > full:
                scales[full] = magnitude[full * self.block:].mean(dtype=xp.float32)
        positive = value >= 0
        out[:4 * nblocks] = scales.astype(xp.float32).view(xp.uint8)
        out[4 * nblocks:] = xp.packbits(positive)
        if residual is not None:  # r = c - (+-scale)
            step = self._per_value(xp, scales, n)
            residual -= xp.where(positive, step, -step)
        return out

    def decode(self, data: Any, out: Any = None, size: int | None = None, accumulate: bool = False) -> Any:
        data, flat, n = self._target(data, out, size)
        xp = devices.array_module(data)
        nblocks = self.blocks(n)
        values = xp.empty(n, xp.float32) if out is None or accumulate else flat
        if n:
            scales = data[:4 * nblocks].view(xp.float32)
            bits = xp.unpackbits(data[4 * nblocks:])[:n]
            step = self._per_value(xp, scales, n)
            xp.multiply(bits.astype(xp.float32) * 2 - 1, step, out=values)
        if out is None:
            return values
        if accumulate:
            flat += values
        return out


# ---- top-k / random-k -------------------------------------------------------------------------------
class SparseScheme(Scheme):
    """``topk`` / ``randomk``: ``k = ceil(ratio n)`` (at least 1) of ``n`` values with their indices.

    ``topk`` keeps the largest in magnitude (``argpartition``, so ties fall as it leaves them,
    the same on every run); ``randomk`` draws them from a generator seeded with ``seed`` (a worker
    passes its own: its draws are its own). With error feedback the values not sent stay in the
    residual and the sent ones leave it.
    """

    def __init__(self, kind: str, ratio: float, error_feedback: bool = True, seed: int = 0) -> None:
        if kind not in ("topk", "randomk"):
            raise ValueError(f"a sparse scheme is topk or randomk, got {kind!r}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"{kind}'s ratio is the fraction of values sent, in (0, 1], got {ratio!r}")
        self.name = kind
        self.ratio = float(ratio)
        self.keeps_residual = bool(error_feedback)
        self._seed = int(seed)
        self._rng = np.random.default_rng(self._seed) if kind == "randomk" else None
        self._rng_lock = threading.Lock()

    def k(self, count: int) -> int:
        """Values sent of ``count``."""
        if count <= 0:
            return 0
        return min(int(count), max(1, math.ceil(self.ratio * count)))

    def encoded_nbytes(self, count: int) -> int:
        return 8 * self.k(count)

    def wire_params(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def sent_indices(self, data: Any) -> Any:
        xp = devices.array_module(data)
        return data[:data.size // 2].view(xp.uint32)

    def encode(self, grad: Any, residual: Any = None) -> Any:
        xp, flat, residual = _check_value(self.name, grad, residual, self.keeps_residual)
        n = int(flat.size)
        if n >= _MAX_INDEXED:
            raise ValueError(f"{self.name} indexes values with 32 bits; a part of {n} values is too long: "
                             "split the key over more servers")
        value = _with_residual(xp, flat, residual)
        k = self.k(n)
        if k == n:
            index = xp.arange(n, dtype=xp.int64)
        elif self._rng is not None:
            with self._rng_lock:
                drawn = self._rng.choice(n, size=k, replace=False)
            index = xp.asarray(np.sort(drawn))
        else:
            index = xp.sort(xp.argpartition(xp.abs(value), n - k)[n - k:])
        out = xp.empty(8 * k, xp.uint8)
        out[:4 * k].view(xp.uint32)[...] = index.astype(xp.uint32)
        out[4 * k:].view(xp.float32)[...] = value[index]
        if residual is not None:
            residual[index] = 0
        return out

    def decode(self, data: Any, out: Any = None, size: int | None = None, accumulate: bool = False) -> Any:
        data, flat, n = self._target(data, out, size)
        xp = devices.array_module(data)
        k = self.k(n)
        index = data[:4 * k].view(xp.uint32)
        values = data[4 * k:].view(xp.float32)
        if k and int(index.max()) >= n:
            raise ValueError(f"{self.name} data names index {int(index.max())} of a value of {n} elements")
        if out is None:
            result = xp.zeros(n, xp.float32)
            result[index] = values
            return result
        if not accumulate:
            flat[...] = 0
            flat[index] = values
        else:  # indices are distinct in what encode makes; a repeat in forged data adds once
            flat[index] += values
        return out
