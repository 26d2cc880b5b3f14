"""Gradient compression kernels: MXNet's ``2bit`` and ``1bit`` quantizers, on numpy and on CuPy.

A worker quantizes each float32 gradient together with a *residual* it keeps (what earlier
gradients left unsent) into packed words; whoever merges dequantizes the words back into float32.
Both ends call these functions, so they sit at the bottom of the house beside ``psnode.devices``:
a server needs nothing but numpy, and ``kvcore.compression`` re-exports them for training code.

**2bit** (MXNet 1.9.1's, bit for bit). ``t > 0``; all arithmetic is float32. Per element::

    r += g;  r >= t: code 11, r -= t;  else r <= -t: code 10, r += t;  else code 00
    dequantize: 11 -> +t, 10 -> -t, 00 and 01 -> 0

16 values per 32-bit word. Element ``j`` of a word sits in byte ``j >> 2`` (memory order), at bits
7-6 when ``j & 3 == 0`` down to bits 1-0 when ``j & 3 == 3``.

**1bit** (MXNet's master branch; not in 1.9.1). Any finite ``t``. Per element::

    r += g;  r > t: bit 1, r -= 1;  else bit 0, r += 1
    dequantize: 1 -> +1, 0 -> -1

32 values per word, 8 per byte, the first in the most significant bit.

Packed data is a ``uint8`` array of ``compressed_nbytes(n)`` bytes, the same bytes MXNet's float32
container of ``compressed_words(n)`` words holds on a little-endian machine; padding bits are zero.
``bytes`` and other buffers are accepted wherever packed data is read, so a server can dequantize a
received frame without copying it. Residuals are updated in place and must live where the gradient
lives; numpy arrays run the numpy kernels, CuPy arrays the CUDA ones, with the same bits.

Every function checks its arguments and raises ``ValueError`` / ``TypeError`` naming the values:
packed data may come from the network.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psnode import devices

from . import cuda_kernels, numpy_kernels

__all__ = [
    "KINDS",
    "values_per_word",
    "compressed_words",
    "compressed_nbytes",
    "split_on_words",
    "check_threshold",
    "quantize",
    "dequantize",
]

KINDS = ("2bit", "1bit")
"""The compression types, by the names MXNet's ``set_gradient_compression`` uses."""

_VALUES_PER_WORD = {"2bit": 16, "1bit": 32}


def values_per_word(kind: str) -> int:
    """How many values one 32-bit word of ``kind`` holds: 16 for 2bit, 32 for 1bit."""
    try:
        return _VALUES_PER_WORD[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown gradient compression type {kind!r}; known types: {', '.join(KINDS)}") from None


def compressed_words(size: int, kind: str) -> int:
    """The number of 32-bit words ``size`` values of ``kind`` pack into: ``ceil(size / 16)`` for 2bit."""
    per_word = values_per_word(kind)
    if size < 0:
        raise ValueError(f"a value count cannot be negative, got {size}")
    return -(-int(size) // per_word)


def compressed_nbytes(size: int, kind: str) -> int:
    """The number of bytes ``size`` values of ``kind`` pack into (4 per word)."""
    return 4 * compressed_words(size, kind)


def split_on_words(size: int, count: int, kind: str) -> list[int]:
    """Element bounds of ``count`` parts of a ``size``-element key, split on whole compressed words.

    Returns ``count + 1`` offsets: part ``i`` holds elements ``[b[i], b[i+1])`` and packed words
    ``[b[i] // per_word, ceil(b[i+1] / per_word))``. Every part but the last holds a whole number of
    words, so its original length is its word count times 16 (2bit) or 32 (1bit); quantizing the
    parts one by one then gives the same bytes as quantizing the key whole. The words are dealt
    evenly (a part may be empty when there are fewer words than parts).
    """
    if count < 1:
        raise ValueError(f"a key is split into at least one part, got {count}")
    words = compressed_words(size, kind)
    per_word = values_per_word(kind)
    return [min(size, (words * i // count) * per_word) for i in range(count)] + [int(size)]


def check_threshold(kind: str, threshold: Any) -> np.float32:
    """``threshold`` as the float32 the kernels use, checked for ``kind``.

    Raises:
        ValueError: not finite, or (2bit) not greater than 0; an unknown ``kind``.
    """
    values_per_word(kind)
    try:
        with np.errstate(over="ignore"):  # past float32's range: inf, refused below naming the value
            value = np.float32(threshold)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the {kind} compression threshold must be a number, got {threshold!r}") from exc
    if not math.isfinite(value):
        raise ValueError(f"the {kind} compression threshold must be a finite number, got {threshold!r}")
    if kind == "2bit" and not value > 0:
        raise ValueError(f"the 2bit compression threshold must be greater than 0, got {threshold!r}")
    return value


# ---- the public kernels ----------------------------------------------------------------------------


def quantize(kind: str, grad: Any, residual: Any, threshold: Any, out: Any = None) -> Any:
    """Quantize ``grad`` into packed bytes, adding it to ``residual`` and keeping what is left there.

    Args:
        kind: ``"2bit"`` or ``"1bit"``.
        grad: a float32 numpy or CuPy array (any shape, read as its flat elements in C order).
        residual: a C-contiguous float32 array of as many elements, where ``grad`` lives; updated
            in place.
        threshold: the threshold (see the module docstring), as float32.
        out: a uint8 array of ``compressed_nbytes(grad.size)`` bytes to write into, else one is
            allocated where ``grad`` lives.

    Returns the packed bytes (``out`` when given). Blocks until the bytes and the residual are
    written (a CuPy call queues its kernel on the current stream, as CuPy operations do).

    Raises:
        TypeError: a dtype other than float32 (uint8 for ``out``); arrays on different devices.
        ValueError: sizes that do not match (naming them); a bad ``threshold`` or ``kind``.
    """
    t = check_threshold(kind, threshold)
    n = int(grad.size)
    _check_float32("the gradient", grad)
    _check_float32("the residual", residual)
    if int(residual.size) != n:
        raise ValueError(f"the residual has {residual.size} elements, but the gradient has {n}")
    if not residual.flags.c_contiguous:
        raise ValueError("the residual must be C-contiguous: it is updated in place")
    xp = _same_module(grad, residual, "the gradient", "the residual")
    nbytes = compressed_nbytes(n, kind)
    if out is not None:
        _check_packed_out(out, nbytes, grad)
    if xp is np:
        if out is None:
            out = np.empty(nbytes, np.uint8)
        numpy_kernels.quantize(kind, np.ascontiguousarray(grad).reshape(-1), residual.reshape(-1), t, out)
        return out
    with grad.device:
        if out is None:
            out = xp.empty(nbytes, np.uint8)
        cuda_kernels.kernel(kind, "quantize")(grad.reshape(-1), np.int64(n), t, residual.reshape(-1), out)
    return out


def dequantize(
    kind: str, packed: Any, threshold: Any, out: Any = None, size: int | None = None, accumulate: bool = False
) -> Any:
    """Unpack ``packed`` into float32 values: written into ``out``, or added to it with ``accumulate``.

    Args:
        kind: ``"2bit"`` or ``"1bit"``.
        packed: the bytes ``quantize`` made: a uint8 numpy or CuPy array, or any buffer (``bytes``,
            ``memoryview``), read without a copy.
        threshold: the threshold they were made with (2bit dequantizes to +-threshold).
        out: a C-contiguous float32 array (any shape; its size is the value count). When None, a
            new array of ``size`` elements is made where ``packed`` lives.
        accumulate: add the values to ``out`` (``out = out + value``, in float32, element by
            element) instead of replacing it: a merge sums pushes in arrival order this way.

    Returns ``out``.

    Raises:
        ValueError: ``packed`` is not ``compressed_nbytes`` long for the value count (naming both),
            neither or both of ``out`` and ``size`` were given, a bad ``threshold`` or ``kind``.
        TypeError: ``out`` is not float32, or not where ``packed`` lives.
    """
    t = check_threshold(kind, threshold)
    packed = _as_packed(packed)
    xp = _module_of(packed)
    if (out is None) == (size is None):
        raise ValueError("dequantize needs exactly one of out= (the array to fill) and size= (the value count)")
    n = int(size) if out is None else int(out.size)
    expected = compressed_nbytes(n, kind)
    if int(packed.size) != expected:
        raise ValueError(
            f"{kind} data for {n} values is {expected} bytes ({compressed_words(n, kind)} words), "
            f"but {packed.size} bytes were given"
        )
    if out is None:
        if accumulate:
            raise ValueError("dequantize(accumulate=True) adds into out=, so it needs one")
        if xp is np:
            out = np.empty(n, np.float32)
        else:
            with packed.device:
                out = xp.empty(n, np.float32)
    _check_float32("the dequantize output", out)
    if not out.flags.c_contiguous:
        raise ValueError("the dequantize output must be C-contiguous")
    _same_module(packed, out, "the packed data", "the dequantize output")
    if xp is np:
        numpy_kernels.dequantize(kind, packed, t, out.reshape(-1), accumulate)
        return out
    with out.device:
        cuda_kernels.kernel(kind, "accumulate" if accumulate else "dequantize")(packed, t, out.reshape(-1))
    return out


# ---- argument checks -------------------------------------------------------------------------------


def _module_of(array: Any) -> Any:
    cp = devices.cupy_module()
    if cp is not None and isinstance(array, cp.ndarray):
        return cp
    return np


def _same_module(a: Any, b: Any, a_name: str, b_name: str) -> Any:
    xp = _module_of(a)
    if _module_of(b) is not xp:
        where = {np: "the host"}.get(xp, "a GPU")
        raise TypeError(f"{a_name} lives on {where} but {b_name} does not; both must be on one device")
    if xp is not np and a.device.id != b.device.id:
        raise TypeError(f"{a_name} is on GPU {a.device.id} but {b_name} is on GPU {b.device.id}")
    return xp


def _check_float32(name: str, array: Any) -> None:
    if np.dtype(array.dtype) != np.float32:
        raise TypeError(f"gradient compression works on float32 values, but {name} is {np.dtype(array.dtype)}")


def _check_packed_out(out: Any, nbytes: int, grad: Any) -> None:
    if np.dtype(out.dtype) != np.uint8 or int(out.size) != nbytes or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous uint8 array of {nbytes} bytes, got {np.dtype(out.dtype)} of {out.size}"
        )
    _same_module(grad, out, "the gradient", "out")


def _as_packed(packed: Any) -> Any:
    if isinstance(packed, np.ndarray) or _module_of(packed) is not np:
        if np.dtype(packed.dtype) != np.uint8:
            raise TypeError(f"packed data must be uint8 bytes, got an array of {np.dtype(packed.dtype)}")
        if not packed.flags.c_contiguous:
            raise ValueError("packed data must be C-contiguous")
        return packed.reshape(-1)
    try:
        return np.frombuffer(packed, dtype=np.uint8)
    except TypeError as exc:
        raise TypeError(f"packed data must be a uint8 array or a bytes-like buffer, got {type(packed).__name__}") from exc
