"""The compression schemes beyond MXNet's (fp16, bf16, 1bit_scaled, topk, randomk): their bits, their
residuals (error feedback), their sizes on the wire, and decoding that refuses what no encoding makes.

The kernels are written against the array module of their arguments, so these tests, run with numpy,
run the code a GPU runs through CuPy (the fallback a machine without a GPU takes); the GPU test
compares the two where a GPU is usable.
"""

import numpy as np
import pytest
import torch

from psnode import devices
from psnode.compression.schemes import HalfScheme, ScaledSignScheme, SparseScheme, from_half, to_half

pytestmark = pytest.mark.unit


def awkward_values(n=20_001, seed=0):
    """float32 values over many magnitudes, with the edges: NaNs, infinities, past fp16's range, denormals."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(n) * rng.choice([1e-8, 1e-3, 1, 1e3, 1e6], n)).astype(np.float32)
    values[:8] = [np.nan, -np.nan, np.inf, -np.inf, 3.4e38, -7e4, 1e-40, -0.0]
    return values


@pytest.mark.parametrize("kind, torch_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_width_bits_are_torchs_rounding_to_nearest_even_and_decode_to_torchs_values(kind, torch_dtype):
    values = awkward_values()
    bits = HalfScheme(kind).encode(values)
    assert bits.dtype == np.uint8 and bits.nbytes == 2 * values.size == HalfScheme(kind).encoded_nbytes(values.size)
    theirs = torch.from_numpy(values).to(torch_dtype)
    ours = bits.view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(ours[~nan], theirs.view(torch.int16).numpy().view(np.uint16)[~nan])
    decoded = HalfScheme(kind).decode(bits, size=values.size)
    assert np.isnan(decoded[nan]).all()
    assert np.array_equal(decoded[~nan], theirs.float().numpy()[~nan])


def test_bf16_rounds_ties_to_even_and_keeps_a_nans_sign():
    # 1 + 2^-8 lies halfway between bf16's 1 and 1 + 2^-7: to even (1); 1 + 3 * 2^-8: up to 1 + 2^-6
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], np.float32)
    assert from_half("bf16", to_half("bf16", values)).tolist() == [1.0, 1 + 2**-6, -1.0]
    negative_nan = np.array([0xFFC00001], np.uint32).view(np.float32)
    assert to_half("bf16", negative_nan).tolist() == [0xFFC0]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_half_width_with_error_feedback_keeps_what_the_rounding_lost(kind):
    scheme = HalfScheme(kind, error_feedback=True)
    assert scheme.keeps_residual and not HalfScheme(kind).keeps_residual
    grad = np.full(1000, 1 + 2**-12, np.float32)  # neither half width holds it
    residual = np.zeros(1000, np.float32)
    sent = [scheme.decode(scheme.encode(grad, residual), size=1000) for _ in range(64)]
    # over the steps what was sent plus what is left is what was pushed, exactly
    assert np.all(np.sum(sent, axis=0, dtype=np.float64) + residual == np.float64(1 + 2**-12) * 64)


@pytest.mark.parametrize("block", [0, 1, 7, 1000, 20_000])
def test_1bit_scaled_sends_a_sign_per_value_and_each_blocks_mean_magnitude(block):
    rng = np.random.default_rng(1)
    grad = rng.standard_normal(10_001).astype(np.float32)
    residual = np.zeros_like(grad)
    scheme = ScaledSignScheme(block)
    data = scheme.encode(grad, residual)
    blocks = 1 if block == 0 else -(-grad.size // block)
    assert data.nbytes == scheme.encoded_nbytes(grad.size) == 4 * blocks + -(-grad.size // 8)
    decoded = scheme.decode(data, size=grad.size)
    width = grad.size if block == 0 else block
    for first in range(0, grad.size, width):
        part = grad[first:first + width]
        scale = np.abs(part).mean(dtype=np.float32)
        assert np.array_equal(decoded[first:first + width], np.where(part >= 0, scale, -scale).astype(np.float32))
    assert np.array_equal(residual, grad - decoded)  # error feedback: the rest stays for the next push


def test_1bit_scaled_with_error_feedback_sends_the_sum_of_its_pushes_over_time():
    rng = np.random.default_rng(2)
    scheme = ScaledSignScheme(64)
    residual = np.zeros(640, np.float32)
    pushed = np.zeros(640, np.float64)
    sent = np.zeros(640, np.float64)
    for _ in range(200):
        grad = rng.standard_normal(640).astype(np.float32)
        pushed += grad
        sent += scheme.decode(scheme.encode(grad, residual), size=640)
    # what was not sent is the residual alone, which stays bounded: the pushes' sum gets through
    assert np.allclose(sent + residual, pushed, atol=1e-3)
    assert np.abs(residual).max() < 10


@pytest.mark.parametrize("ratio, k", [(0.01, 101), (0.5, 5001), (1.0, 10_001), (1e-9, 1)])
def test_topk_sends_the_k_largest_magnitudes_with_ascending_indices_and_keeps_the_rest(ratio, k):
    rng = np.random.default_rng(3)
    grad = rng.standard_normal(10_001).astype(np.float32)
    residual = np.full_like(grad, 0.25)
    scheme = SparseScheme("topk", ratio)
    data = scheme.encode(grad, residual)
    assert scheme.k(grad.size) == k and data.nbytes == 8 * k == scheme.encoded_nbytes(grad.size)
    index = data[:4 * k].view(np.uint32)
    values = data[4 * k:].view(np.float32)
    combined = grad + np.float32(0.25)
    assert np.all(np.diff(index.astype(np.int64)) > 0)
    assert np.array_equal(values, combined[index])
    chosen = np.zeros(grad.size, bool)
    chosen[index] = True
    assert np.abs(combined[chosen]).min() >= np.abs(combined[~chosen]).max(initial=0)
    assert np.array_equal(residual, np.where(chosen, 0, combined))
    assert np.array_equal(scheme.decode(data, size=grad.size), np.where(chosen, combined, 0))


def test_randomk_draws_distinct_indices_from_its_seed_and_the_same_seed_draws_the_same():
    grad = np.arange(1000, dtype=np.float32)
    first = [SparseScheme("randomk", 0.05, seed=7).encode(grad, np.zeros(1000, np.float32)) for _ in range(2)]
    assert first[0].tobytes() == first[1].tobytes()
    other = SparseScheme("randomk", 0.05, seed=8).encode(grad, np.zeros(1000, np.float32))
    assert other.tobytes() != first[0].tobytes()
    index = first[0][:200].view(np.uint32)
    assert len(set(index.tolist())) == 50 and np.all(np.diff(index.astype(np.int64)) > 0)
    scheme = SparseScheme("randomk", 0.05, seed=7)  # one generator: each push draws anew
    residual = np.zeros(1000, np.float32)
    assert scheme.encode(grad, residual).tobytes() != scheme.encode(grad, residual).tobytes()


@pytest.mark.parametrize("scheme", [HalfScheme("fp16"), ScaledSignScheme(16), SparseScheme("topk", 0.1)],
                         ids=lambda s: s.name)
def test_decoding_adds_into_out_as_a_merge_does(scheme):
    grad = np.random.default_rng(4).standard_normal(100).astype(np.float32)
    residual = np.zeros(100, np.float32)
    data = scheme.encode(grad, residual if scheme.keeps_residual else None)
    out = np.full(100, 2, np.float32)
    scheme.decode(data, out, accumulate=True)
    assert np.array_equal(out, np.float32(2) + scheme.decode(data, size=100))


@pytest.mark.parametrize("scheme", [HalfScheme("bf16"), ScaledSignScheme(0), SparseScheme("randomk", 0.5)],
                         ids=lambda s: s.name)
def test_zero_values_encode_to_nothing_and_decode_back(scheme):
    empty = np.zeros(0, np.float32)
    data = scheme.encode(empty, empty if scheme.keeps_residual else None)
    assert data.nbytes == scheme.encoded_nbytes(0) == 0
    assert scheme.decode(data, size=0).size == 0


def test_decoding_refuses_a_wrong_length_and_an_index_past_the_end_naming_them():
    with pytest.raises(ValueError, match="fp16 data for 10 values is 20 bytes, but 19 bytes were given"):
        HalfScheme("fp16").decode(bytes(19), size=10)
    forged = np.array([3, 10], np.uint32).tobytes() + np.ones(2, np.float32).tobytes()
    with pytest.raises(ValueError, match="topk data names index 10 of a value of 10 elements"):
        SparseScheme("topk", 0.2).decode(forged, size=10)
    with pytest.raises(TypeError, match="C-contiguous float32"):
        HalfScheme("fp16").decode(bytes(20), out=np.zeros(10, np.float64))


def test_bad_parameters_and_values_are_refused_naming_them():
    with pytest.raises(ValueError, match="ratio is the fraction of values sent, in \\(0, 1\\], got 0"):
        SparseScheme("topk", 0)
    with pytest.raises(ValueError, match="block is a count of values .* got -1"):
        ScaledSignScheme(-1)
    with pytest.raises(TypeError, match="encodes float32 values, got float64"):
        HalfScheme("fp16").encode(np.zeros(3))
    with pytest.raises(ValueError, match="residual must be a C-contiguous float32 array of 3 values, got float32 of 4"):
        SparseScheme("topk", 0.5).encode(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="needs a residual"):
        ScaledSignScheme(0).encode(np.zeros(3, np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not devices.gpu_available(), reason=f"needs a CUDA GPU: {devices.gpu_status()}")
@pytest.mark.parametrize("scheme", [HalfScheme("fp16"), HalfScheme("bf16"), ScaledSignScheme(256),
                                    SparseScheme("topk", 0.01)], ids=lambda s: s.name)
def test_on_a_gpu_every_scheme_gives_the_numpy_bits(scheme):
    cp = devices.cupy_module()
    grad = np.random.default_rng(5).standard_normal(100_000).astype(np.float32)
    residual = np.zeros_like(grad)
    gpu_residual = cp.asarray(residual)
    host = scheme.encode(grad, residual if scheme.keeps_residual else None)
    gpu = scheme.encode(cp.asarray(grad), gpu_residual if scheme.keeps_residual else None)
    if scheme.name == "1bit_scaled":  # a GPU's reduction may order the mean's sum otherwise: the signs agree
        assert cp.asnumpy(gpu)[1024:].tobytes() == host[1024:].tobytes()
        assert np.allclose(cp.asnumpy(gpu)[:1024].view(np.float32), host[:1024].view(np.float32), rtol=1e-5)
    else:
        assert cp.asnumpy(gpu).tobytes() == host.tobytes()
        assert cp.asnumpy(gpu_residual).tobytes() == residual.tobytes()
    assert cp.asnumpy(scheme.decode(gpu, size=grad.size)).tobytes() == scheme.decode(host, size=grad.size).tobytes() \
        or scheme.name == "1bit_scaled"
