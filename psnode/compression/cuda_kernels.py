"""The CUDA kernels of ``psnode.compression``, as CuPy ElementwiseKernels, bit for bit the numpy ones.

One thread per packed byte for quantize (it owns that byte's 4 or 8 elements and their residuals),
one per value for dequantize. The bodies are plain C, so the tests also compile them with the
host's C compiler and compare them with the numpy kernels: the CUDA source is checked on machines
without a GPU too. ``--fmad=false`` keeps the compiler from fusing anything, and denormals are kept
(no ``--ftz``), as numpy and MXNet keep them. CuPy comes from ``psnode.devices``, the one module
that imports it; arguments are checked by the caller.
"""

from __future__ import annotations

import threading
from typing import Any

from psnode import devices

__all__ = ["CUDA_SOURCES", "kernel"]


def _quantize_source(per_byte: int, decide: str) -> str:
    """A quantize body: one thread per packed byte adds the gradient to each of its ``per_byte``
    residuals, lets ``decide`` set the element's bits in ``byte`` and adjust ``r``, and stores both."""
    return f"""
        const long long first = {per_byte}LL * (long long)i;
        unsigned int byte = 0u;
        for (int k = 0; k < {per_byte}; ++k) {{
            const long long j = first + k;
            if (j < n) {{
                float r = residual[j] + grad[j];
{decide}
                residual[j] = r;
            }}
        }}
        out = (unsigned char)byte;
        """


_QUANTIZE_PARAMS = ("raw float32 grad, int64 n, float32 t", "raw float32 residual, uint8 out")
CUDA_SOURCES = {
    ("2bit", "quantize"): _QUANTIZE_PARAMS + (_quantize_source(4, """
                if (r >= t) {
                    byte |= 0xC0u >> (2 * k);
                    r = r - t;
                } else if (r <= -t) {
                    byte |= 0x80u >> (2 * k);
                    r = r - (-t);
                }"""),),
    ("1bit", "quantize"): _QUANTIZE_PARAMS + (_quantize_source(8, """
                if (r > t) {
                    byte |= 0x80u >> k;
                    r = r - 1.0f;
                } else {
                    r = r + 1.0f;
                }"""),),
}

# A dequantizer computes ``v`` for value ``i``, then stores it or adds it to what ``out`` holds.
_DEQUANTIZED_VALUE = {
    "2bit": """
        const unsigned int code = ((unsigned int)packed[i >> 2] >> (6 - 2 * (int)(i & 3))) & 3u;
        const float v = code == 3u ? t : (code == 2u ? -t : 0.0f);
        """,
    "1bit": """
        const unsigned int bit = ((unsigned int)packed[i >> 3] >> (7 - (int)(i & 7))) & 1u;
        const float v = bit ? 1.0f : -1.0f;
        """,
}
for _kind, _value in _DEQUANTIZED_VALUE.items():
    CUDA_SOURCES[(_kind, "dequantize")] = ("raw uint8 packed, float32 t", "float32 out", _value + "out = v;\n")
    CUDA_SOURCES[(_kind, "accumulate")] = ("raw uint8 packed, float32 t", "float32 out", _value + "out = out + v;\n")

_cuda_kernels: dict[tuple[str, str], Any] = {}
_cuda_lock = threading.Lock()


def kernel(kind: str, op: str) -> Any:
    """The CuPy ElementwiseKernel for ``(kind, op)``, made on first use (CuPy compiles per device)."""
    kernel = _cuda_kernels.get((kind, op))
    if kernel is None:
        with _cuda_lock:
            kernel = _cuda_kernels.get((kind, op))
            if kernel is None:
                in_params, out_params, body = CUDA_SOURCES[(kind, op)]
                kernel = devices.cupy_module().ElementwiseKernel(
                    in_params, out_params, body, f"pslaunch_{op}_{kind}", options=("--fmad=false",)
                )
                _cuda_kernels[(kind, op)] = kernel
    return kernel
