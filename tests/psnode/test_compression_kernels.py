"""The compression kernels: MXNet's 2bit and 1bit layouts by hand, residual carry, sizes, and the
CUDA kernels against the numpy ones (on a GPU, and compiled as C on the host)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from psnode import devices
from psnode.compression import (
    compressed_nbytes,
    compressed_words,
    dequantize,
    quantize,
    split_on_words,
)
from psnode.compression.cuda_kernels import CUDA_SOURCES

F32 = np.float32
needs_gpu = pytest.mark.skipif(not devices.gpu_available(), reason="needs a CUDA GPU with a working CuPy")


def f32(*values):
    return np.array(values, F32)


def hexbytes(packed) -> str:
    return bytes(devices.asnumpy(packed)).hex(" ")


def gradients(rng, size):
    """Normal values, multiples of 1/8 (so residuals land exactly on the thresholds 0.5 and 0), denormals."""
    g = (rng.standard_normal(size) * 0.4).astype(F32)
    g[1::3] = rng.integers(-8, 9, g[1::3].size).astype(F32) / F32(8)
    g[2::7] = rng.standard_normal(g[2::7].size).astype(F32) * F32(1e-39)
    return g


# ---- 2bit, by hand ---------------------------------------------------------------------------------


def test_2bit_packs_four_codes_per_byte_first_element_in_the_top_bits():
    g = f32(0.5, -0.5, 0.25, 1.0,  -2.0, 0.0, 0.75, -0.75,  0.5, 0.5, -0.5, -0.5,  0, 0, 0, 1.0,  -1.0)
    residual = np.zeros(17, F32)
    packed = quantize("2bit", g, residual, 0.5)
    # codes 11 10 00 11 | 10 00 11 10 | 11 11 10 10 | 00 00 00 11 || 10 and zero padding
    assert hexbytes(packed) == "e3 8e fa 03 80 00 00 00"
    assert packed.dtype == np.uint8 and packed.size == 8  # ceil(17 / 16) = 2 words
    assert int(packed[:4].view("<u4")[0]) == 0x03FA8EE3  # the first word as MXNet's float32 container holds it
    assert residual.tolist() == [0, 0, 0.25, 0.5, -1.5, 0, 0.25, -0.25, 0, 0, 0, 0, 0, 0, 0, 0.5, -0.5]
    values = dequantize("2bit", packed, 0.5, size=17)
    assert values.tolist() == [0.5, -0.5, 0, 0.5, -0.5, 0, 0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0.5, -0.5]


def test_2bit_code_01_dequantizes_to_zero_like_00():
    assert dequantize("2bit", bytes([0b01_00_11_10, 0, 0, 0]), 2.0, size=4).tolist() == [0, 0, 2, -2]


def test_2bit_residual_carries_over_pushes_and_the_threshold_itself_sends():
    residual = np.zeros(2, F32)
    g = f32(0.375, -0.375)
    sent = [hexbytes(quantize("2bit", g, residual, 0.5)) for _ in range(5)]
    # r: .375 (00) -> .75 (send, .25) -> .625 (send, .125) -> .5 (>= t: send, 0) -> .375 (00)
    assert sent == ["00 00 00 00", "e0 00 00 00", "e0 00 00 00", "e0 00 00 00", "00 00 00 00"]
    assert residual.tolist() == [0.375, -0.375]


def test_2bit_residual_arithmetic_rounds_in_float32_as_mxnet_does():
    residual = np.zeros(1, F32)
    for _ in range(3):
        quantize("2bit", f32(0.3), residual, 0.5)
    # 0.3f + 0.3f = 0.6f, minus 0.5f, plus 0.3f: each step rounded to float32
    expected = F32(F32(F32(0.3) + F32(0.3)) - F32(0.5))
    expected = F32(F32(expected + F32(0.3)))
    assert residual.tobytes() == f32(expected).tobytes()


# ---- 1bit, by hand ---------------------------------------------------------------------------------


def test_1bit_packs_eight_bits_per_byte_most_significant_first():
    g = f32(1, -1, 0.5, -0.5, 0, 2, -2, 0.25, 3)
    residual = np.zeros(9, F32)
    packed = quantize("1bit", g, residual, 0.0)
    assert hexbytes(packed) == "a5 80 00 00"  # 1 0 1 0 0 1 0 1 | 1, zero padding to a word
    assert residual.tolist() == [0, 0, -0.5, 0.5, 1, 1, -1, -0.75, 2]  # r - 1 for a 1 bit, r + 1 for a 0 bit
    assert dequantize("1bit", packed, 0.0, size=9).tolist() == [1, -1, 1, -1, -1, 1, -1, 1, 1]


def test_1bit_residual_carries_over_pushes():
    residual = np.zeros(1, F32)
    sent = [hexbytes(quantize("1bit", f32(0.25), residual, 0.5)) for _ in range(4)]
    # r: .25 (0, 1.25) -> 1.5 (1, .5) -> .75 (1, -.25) -> 0 (0, 1)
    assert sent == ["00 00 00 00", "80 00 00 00", "80 00 00 00", "00 00 00 00"]
    assert residual.tolist() == [1.0]


# ---- sizes and splits ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, words_2bit, words_1bit",
    [(0, 0, 0), (1, 1, 1), (15, 1, 1), (16, 1, 1), (17, 2, 1), (32, 2, 1), (33, 3, 2), (1_000_003, 62_501, 31_251)],
)
def test_compressed_sizes_are_ceil_n_over_16_and_32_words(size, words_2bit, words_1bit):
    assert compressed_words(size, "2bit") == words_2bit and compressed_nbytes(size, "2bit") == 4 * words_2bit
    assert compressed_words(size, "1bit") == words_1bit and compressed_nbytes(size, "1bit") == 4 * words_1bit


def reference_quantize(kind, grad, residual, t):
    """An independent vectorised quantizer (np.where and bit arrays), unchunked."""
    t = F32(t)
    residual += grad
    if kind == "2bit":
        pos, neg = residual >= t, residual <= -t
        residual[:] = np.where(pos, residual - t, np.where(neg, residual - (-t), residual))
        bits = np.stack([pos | neg, pos], axis=1).reshape(-1)
    else:
        bits = residual > t
        residual[:] = np.where(bits, residual - F32(1), residual + F32(1))
    packed = np.packbits(bits)
    return np.concatenate([packed, np.zeros(compressed_nbytes(grad.size, kind) - packed.size, np.uint8)])


@pytest.mark.parametrize("kind, t", [("2bit", 0.5), ("2bit", 0.1), ("1bit", 0.0), ("1bit", 0.5)])
@pytest.mark.parametrize("size", [1, 15, 16, 17, 16_385, 1_000_003])
def test_chunked_kernels_match_an_unchunked_reference_over_several_pushes(kind, t, size):
    rng = np.random.default_rng(size)
    ours, reference = np.zeros(size, F32), np.zeros(size, F32)
    for _ in range(3):
        g = gradients(rng, size)
        packed = quantize(kind, g, ours, t)
        assert packed.tobytes() == reference_quantize(kind, g, reference, t).tobytes()
        assert ours.tobytes() == reference.tobytes()
    values = dequantize(kind, packed, t, size=size)
    bits = np.unpackbits(packed)
    if kind == "2bit":
        codes = (bits[0::2][:size] << 1) | bits[1::2][:size]
        expected = np.where(codes == 3, F32(t), np.where(codes == 2, -F32(t), F32(0)))
    else:
        expected = np.where(bits[:size] == 1, F32(1), F32(-1))
    assert values.tobytes() == expected.astype(F32).tobytes()


def test_dequantize_accumulate_adds_in_float32_and_reads_any_buffer():
    out = f32(0.1, 0.2, 0.3)
    packed = quantize("2bit", f32(1, -1, 0), np.zeros(3, F32), 0.1)
    dequantize("2bit", memoryview(packed.tobytes()), 0.1, out=out, accumulate=True)
    assert out.tobytes() == f32(F32(0.1) + F32(0.1), F32(0.2) - F32(0.1), F32(0.3)).tobytes()


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_split_on_words_parts_quantized_alone_give_the_whole_keys_bytes(kind):
    size, count = 1_000_003, 3
    bounds = split_on_words(size, count, kind)
    per_word = 16 if kind == "2bit" else 32
    assert bounds[0] == 0 and bounds[-1] == size and len(bounds) == count + 1
    assert all(b % per_word == 0 for b in bounds[:-1])
    g = np.random.default_rng(1).standard_normal(size).astype(F32)
    whole = quantize(kind, g, np.zeros(size, F32), 0.5)
    parts = [quantize(kind, g[a:b], np.zeros(b - a, F32), 0.5) for a, b in zip(bounds, bounds[1:])]
    assert np.concatenate(parts).tobytes() == whole.tobytes()
    assert [p.size // 4 for p in parts[:-1]] == [(b - a) // per_word for a, b in zip(bounds, bounds[1:-1])]


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_an_empty_gradient_packs_into_no_bytes(kind):
    packed = quantize(kind, np.zeros(0, F32), np.zeros(0, F32), 0.5)
    assert packed.size == 0 and dequantize(kind, packed, 0.5, size=0).size == 0


def test_split_on_words_leaves_parts_empty_when_words_run_out():
    assert split_on_words(20, 4, "2bit") == [0, 0, 16, 16, 20]


# ---- bad arguments ---------------------------------------------------------------------------------


def test_dequantize_of_the_wrong_length_names_both_lengths():
    with pytest.raises(ValueError, match=r"2bit data for 17 values is 8 bytes \(2 words\), but 4 bytes"):
        dequantize("2bit", bytes(4), 0.5, size=17)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: quantize("2bit", np.zeros(4, np.float16), np.zeros(4, F32), 0.5), TypeError, "float16"),
        (lambda: quantize("2bit", np.zeros(4, F32), np.zeros(5, F32), 0.5), ValueError, "5 elements.*has 4"),
        (lambda: quantize("2bit", np.zeros(4, F32), np.zeros(4, F32), 0.0), ValueError, "greater than 0, got 0.0"),
        (lambda: quantize("2bit", np.zeros(4, F32), np.zeros(4, F32), float("nan")), ValueError, "finite"),
        (lambda: quantize("3bit", np.zeros(4, F32), np.zeros(4, F32), 0.5), ValueError, "'3bit'.*2bit, 1bit"),
        (lambda: quantize("2bit", np.zeros(4, F32), np.zeros(4, F32), 0.5, out=np.zeros(8, np.uint8)),
         ValueError, "4 bytes, got uint8 of 8"),
        (lambda: dequantize("2bit", bytes(4), 0.5), ValueError, "exactly one of out= .* and size="),
        (lambda: dequantize("2bit", np.zeros(4, np.int32), 0.5, size=16), TypeError, "uint8 bytes, got.*int32"),
        (lambda: dequantize("1bit", bytes(4), 0.5, out=np.zeros(8)), TypeError, "float64"),
    ],
)
def test_bad_arguments_raise_errors_naming_the_values(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_1bit_takes_any_finite_threshold_even_zero_or_below():
    assert hexbytes(quantize("1bit", f32(-0.5), np.zeros(1, F32), -1.0)) == "80 00 00 00"


# ---- the CUDA kernels ------------------------------------------------------------------------------

CASES = [("2bit", 0.5), ("2bit", 0.1), ("1bit", 0.0), ("1bit", 0.5)]

SIZES = [1, 15, 16, 17, 33, 1_000_003]


@needs_gpu
@pytest.mark.parametrize("kind, t", CASES)
def test_cupy_kernels_match_the_numpy_kernels_bit_for_bit(kind, t):
    cp = devices.cupy_module()
    for size in SIZES:
        rng = np.random.default_rng(size)
        host_residual = np.zeros(size, F32)
        gpu_residual = cp.zeros(size, F32)
        host_sum = np.full(size, 0.25, F32)
        gpu_sum = cp.asarray(host_sum)
        for _ in range(3):
            g = gradients(rng, size)
            host_packed = quantize(kind, g, host_residual, t)
            gpu_packed = quantize(kind, cp.asarray(g), gpu_residual, t)
            assert isinstance(gpu_packed, cp.ndarray)
            assert cp.asnumpy(gpu_packed).tobytes() == host_packed.tobytes(), (kind, size)
            assert cp.asnumpy(gpu_residual).tobytes() == host_residual.tobytes(), (kind, size)
            dequantize(kind, host_packed, t, out=host_sum, accumulate=True)
            dequantize(kind, gpu_packed, t, out=gpu_sum, accumulate=True)
            assert cp.asnumpy(gpu_sum).tobytes() == host_sum.tobytes(), (kind, size)
            assert cp.asnumpy(dequantize(kind, gpu_packed, t, size=size)).tobytes() == \
                dequantize(kind, host_packed, t, size=size).tobytes()


_C_TYPES = {"float32": ("float", ctypes.c_float), "int64": ("long long", ctypes.c_longlong),
            "uint8": ("unsigned char", ctypes.c_ubyte)}


def _c_function(name, in_params, out_params, body):
    """The ElementwiseKernel ``body`` as a C function looping ``i`` over the first non-raw output."""
    params, argtypes, defines = ["long long count"], [ctypes.c_longlong], []
    specs = [(spec, False) for spec in in_params.split(",")] + [(spec, True) for spec in out_params.split(",")]
    for spec, is_output in specs:
        words = spec.split()
        ctype, cscalar = _C_TYPES[words[-2]]
        if words[0] == "raw":
            params.append(f"{ctype} *{words[-1]}")
            argtypes.append(ctypes.c_void_p)
        elif is_output:
            params.append(f"{ctype} *{words[-1]}_array")
            argtypes.append(ctypes.c_void_p)
            defines.append(words[-1])
        else:
            params.append(f"{ctype} {words[-1]}")
            argtypes.append(cscalar)
    macros = "".join(f"#define {d} ({d}_array[i])\n" for d in defines)
    undefs = "".join(f"#undef {d}\n" for d in defines)
    source = f"void {name}({', '.join(params)}) {{\n{macros}for (long long i = 0; i < count; ++i) {{\n{body}\n}}\n{undefs}}}\n"
    return source, argtypes


@pytest.fixture(scope="module")
def c_kernels(tmp_path_factory):
    """The CUDA kernel sources compiled by the host's C compiler into one library."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    folder = tmp_path_factory.mktemp("cuda_as_c")
    sources, signatures = [], {}
    for (kind, op), (ins, outs, body) in CUDA_SOURCES.items():
        name = f"k_{op}_{kind}"
        source, argtypes = _c_function(re.sub(r"\W", "_", name), ins, outs, body)
        sources.append(source)
        signatures[(kind, op)] = (name, argtypes)
    (folder / "kernels.c").write_text("\n".join(sources))
    # -ffp-contract=off: no fused multiply-adds, as the GPU build asks with --fmad=false
    subprocess.run([compiler, "-O2", "-std=c99", "-ffp-contract=off", "-shared", "-fPIC", "-o",
                    str(folder / "kernels.so"), str(folder / "kernels.c")], check=True, timeout=60)
    library = ctypes.CDLL(str(folder / "kernels.so"))
    functions = {}
    for key, (name, argtypes) in signatures.items():
        fn = getattr(library, re.sub(r"\W", "_", name))
        fn.argtypes, fn.restype = argtypes, None
        functions[key] = fn
    return functions


@pytest.mark.parametrize("kind, t", CASES)
def test_cuda_kernel_sources_compiled_as_c_match_the_numpy_kernels(c_kernels, kind, t):
    for size in SIZES:
        rng = np.random.default_rng(size)
        numpy_residual, c_residual = np.zeros(size, F32), np.zeros(size, F32)
        numpy_sum, c_sum = np.full(size, 0.25, F32), np.full(size, 0.25, F32)
        for _ in range(3):
            g = gradients(rng, size)
            packed = quantize(kind, g, numpy_residual, t)
            c_packed = np.empty(compressed_nbytes(size, kind), np.uint8)
            c_kernels[(kind, "quantize")](c_packed.size, g.ctypes.data, size, t, c_residual.ctypes.data,
                                          c_packed.ctypes.data)
            assert c_packed.tobytes() == packed.tobytes(), (kind, size)
            assert c_residual.tobytes() == numpy_residual.tobytes(), (kind, size)
            dequantize(kind, packed, t, out=numpy_sum, accumulate=True)
            c_kernels[(kind, "accumulate")](size, c_packed.ctypes.data, t, c_sum.ctypes.data)
            assert c_sum.tobytes() == numpy_sum.tobytes(), (kind, size)
        c_values = np.empty(size, F32)
        c_kernels[(kind, "dequantize")](size, c_packed.ctypes.data, t, c_values.ctypes.data)
        assert c_values.tobytes() == dequantize(kind, packed, t, size=size).tobytes()
