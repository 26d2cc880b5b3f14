"""Deterministic float32 gradients and digests, numpy only: shared by the compression tests and the
worker scripts they start (which also run under MXNet's own Python to make the frozen vectors)."""

from __future__ import annotations

import hashlib

import numpy as np

F32 = np.float32


def make_grad(n: int, seed: int, scale_bits: int = 2) -> np.ndarray:
    """Deterministic float32 gradients in about [-1.5, 1.5), the same bits under any numpy version."""
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = i * np.uint64(6364136223846793005) + np.uint64(1442695040888963407 + 7919 * seed)
        x ^= x >> np.uint64(29)
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    mantissa = (x >> np.uint64(41)).astype(np.int64) - (1 << 22)
    g = mantissa.astype(F32) * F32(2.0**-22)
    shift = ((x >> np.uint64(8)) & np.uint64((1 << scale_bits) - 1)).astype(np.int64)
    return (g * np.exp2(-shift.astype(F32)).astype(F32) * F32(1.5)).astype(F32)


def digest(array: np.ndarray) -> str:
    """The first 16 hex digits of the sha256 of ``array``'s float32 bytes."""
    return hashlib.sha256(np.ascontiguousarray(array, F32).tobytes()).hexdigest()[:16]


def refused(call, error: type, *words: str) -> None:
    """Check that ``call()`` raises ``error`` whose message holds every one of ``words``."""
    try:
        call()
    except error as exc:
        assert all(w in str(exc) for w in words), (words, exc)
    else:
        raise AssertionError(f"no {error.__name__} naming {words}")
