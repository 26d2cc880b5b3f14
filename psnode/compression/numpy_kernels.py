"""The numpy kernels of ``psnode.compression``: vectorised, no Python loop over elements.

They work through a gradient in passes over cache-sized chunks. Every residual update is the one
MXNet's loop makes (``r - t``, ``r - (-t)``, ``r - 1``, ``r - (-1)``, or ``r - 0``, which leaves
``r``'s bits as they are), so residuals match MXNet's bit for bit too, not only the packed codes.
Arguments are checked by the caller (``psnode.compression.quantize`` / ``dequantize``).
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["quantize", "dequantize"]

# Elements per pass: the temporaries of a pass stay in the CPU's cache for the next one
# (a multiple of 32, so chunks hold whole words of either kind).
_CHUNK = 1 << 14
_VALUES_PER_BYTE = {"2bit": 4, "1bit": 8}

# Four codes (one per byte of a little-endian uint32, each 0..3) times this constant put
# code0 << 6 | code1 << 4 | code2 << 2 | code3 into the top byte; the cross products land in bits
# below 24 or above 31 and do not carry into it.
_SPREAD = (1 << 30) | (1 << 20) | (1 << 10) | 1
_POS_SPREAD = np.uint32((3 * _SPREAD) & 0xFFFFFFFF)  # code 11 for a positive element
_NEG_SPREAD = np.uint32((2 * _SPREAD) & 0xFFFFFFFF)  # code 10 for a negative one


def _chunk_size(n: int) -> int:
    """Elements per pass for ``n`` values: ``_CHUNK``, or ``n`` rounded up to whole words of either kind."""
    return min(_CHUNK, -(-n // 32) * 32)


def _added_chunks(grad: np.ndarray, residual: np.ndarray, chunk: int):
    """Yield ``(start, r)`` per chunk, ``r`` the residual's chunk with the gradient added in place."""
    for start in range(0, grad.size, chunk):
        r = residual[start : start + chunk]
        np.add(r, grad[start : start + chunk], out=r)
        yield start, r


def _quantize_2bit_numpy(grad: np.ndarray, residual: np.ndarray, t: np.float32, out: np.ndarray) -> None:
    n = grad.size
    neg_t = np.float32(-t)
    chunk = _chunk_size(n)
    pos = np.zeros(chunk, bool)
    neg = np.zeros(chunk, bool)
    sign = np.empty(chunk, np.int8)
    step = np.empty(chunk, np.float32)
    word = np.empty(chunk // 4, np.uint32)
    spare = np.empty(chunk // 4, np.uint32)
    for start, r in _added_chunks(grad, residual, chunk):
        m = r.size
        np.greater_equal(r, t, out=pos[:m])
        np.less_equal(r, neg_t, out=neg[:m])
        if m < chunk:  # the last, short chunk: its padding elements code as 00
            pos[m:] = False
            neg[m:] = False
        # r -= t for code 11, r -= -t for code 10, r -= +0 (no change) for code 00
        np.subtract(pos[:m].view(np.int8), neg[:m].view(np.int8), out=sign[:m])
        np.multiply(sign[:m], t, out=step[:m], dtype=np.float32)
        np.subtract(r, step[:m], out=r)
        # four bools per little-endian uint32 -> one packed byte
        m4 = -(-m // 4)
        w, s = word[:m4], spare[:m4]
        np.multiply(pos[: 4 * m4].view("<u4"), _POS_SPREAD, out=w)
        np.multiply(neg[: 4 * m4].view("<u4"), _NEG_SPREAD, out=s)
        np.add(w, s, out=w)
        np.right_shift(w, 24, out=w)
        out[start // 4 : start // 4 + m4] = w
    out[-(-n // 4) :] = 0  # padding bytes of the last word


def _quantize_1bit_numpy(grad: np.ndarray, residual: np.ndarray, t: np.float32, out: np.ndarray) -> None:
    n = grad.size
    chunk = _chunk_size(n)
    bit = np.empty(chunk, bool)
    step = np.empty(chunk, np.int8)
    for start, r in _added_chunks(grad, residual, chunk):
        m = r.size
        np.greater(r, t, out=bit[:m])
        # r -= 1 for a 1 bit, r -= -1 for a 0 bit
        np.left_shift(bit[:m].view(np.int8), 1, out=step[:m])
        np.subtract(step[:m], 1, out=step[:m])
        np.subtract(r, step[:m], out=r)
        packed = np.packbits(bit[:m])  # most significant bit first; a short last byte is zero-padded
        out[start // 8 : start // 8 + packed.size] = packed
    out[-(-n // 8) :] = 0


_QUANTIZERS = {"2bit": _quantize_2bit_numpy, "1bit": _quantize_1bit_numpy}


def quantize(kind: str, grad: np.ndarray, residual: np.ndarray, t: np.float32, out: np.ndarray) -> None:
    """Quantize flat float32 ``grad`` with flat ``residual`` (updated) into uint8 ``out``."""
    if grad.size:
        _QUANTIZERS[kind](grad, residual, t, out)

_tables: dict[tuple[str, bytes], np.ndarray] = {}
_tables_lock = threading.Lock()


def _table(kind: str, t: np.float32) -> np.ndarray:
    """``table[b]``: the float32 values packed byte ``b`` stands for (4 for 2bit, 8 for 1bit)."""
    key = (kind, t.tobytes())
    table = _tables.get(key)
    if table is None:
        byte = np.arange(256, dtype=np.uint8)
        if kind == "2bit":
            codes = (byte[:, None] >> np.array([6, 4, 2, 0], np.uint8)) & 3
            table = np.where(codes == 3, t, np.where(codes == 2, np.float32(-t), np.float32(0))).astype(np.float32)
        else:
            bits = np.unpackbits(byte[:, None], axis=1)
            table = np.where(bits == 1, np.float32(1), np.float32(-1)).astype(np.float32)
        with _tables_lock:
            if len(_tables) > 64:  # thresholds change rarely; keep the cache small all the same
                _tables.clear()
            _tables[key] = table
    return table


def dequantize(kind: str, packed: np.ndarray, t: np.float32, out: np.ndarray, accumulate: bool) -> None:
    """Write (or with ``accumulate`` add) the values of uint8 ``packed`` into flat float32 ``out``."""
    n = out.size
    if n == 0:
        return
    table = _table(kind, t)
    per_byte = _VALUES_PER_BYTE[kind]
    chunk = _chunk_size(n)
    values = np.empty((chunk // per_byte, per_byte), np.float32)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        m = stop - start
        first = start // per_byte
        used = -(-m // per_byte)
        np.take(table, packed[first : first + used], axis=0, out=values[:used])
        flat = values.reshape(-1)[:m]
        if accumulate:
            np.add(out[start:stop], flat, out=out[start:stop])
        else:
            out[start:stop] = flat
