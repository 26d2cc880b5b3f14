"""Compression beyond MXNet's types on every store that compresses: fp16, bf16, 1bit_scaled, topk and
randomk on the dist stores (pushes encoded, pulls at half width when asked), the allreduce store
(encodings gathered, decoded in rank order) and the device store; the parameters and their errors.

The dist stores run whole jobs inside this process (``InProcJob``: the real scheduler, two servers
and two workers on threads); the allreduce store runs real processes on 127.0.0.1 (3 workers, no
servers). Each worker script checks every pull bit for bit against a reference it computes with the
same schemes (``dist_scripts/codec_rounds.py``, ``dist_scripts/codec_sums.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvcore_testkit import run_inproc_ok, run_job_ok

import kvcore
from kvcore.compression import parse_params
from psnode.compression.schemes import HalfScheme, ScaledSignScheme, SparseScheme

HERE = Path(__file__).parent
CODECS = [
    {"type": "fp16"},
    {"type": "bf16"},
    {"type": "1bit_scaled"},
    {"type": "1bit_scaled", "block": 1000},
    {"type": "topk", "ratio": 0.01},
    {"type": "randomk", "ratio": 0.05, "seed": 3},
    {"type": "topk", "pull": "bf16"},
    {"type": "fp16", "pull": "float32", "error_feedback": True},
    {"type": "2bit", "threshold": 0.5, "pull": "fp16"},
]


def ids(params):
    return "-".join(f"{v}" for v in params.values())


@pytest.mark.parametrize("params", CODECS, ids=ids)
@pytest.mark.parametrize("store", ["dist_sync", "dist_device_sync"])
def test_a_dist_store_pushes_encoded_values_and_pulls_the_exact_sums_at_the_width_asked(store, params):
    run_inproc_ok([str(HERE / "dist_scripts" / "codec_rounds.py"), store, json.dumps(params)], 2, 2,
                  {"PSLAUNCH_BIGARRAY_BOUND": "100000"})


@pytest.mark.parametrize("params", [{"type": "fp16"}, {"type": "topk", "ratio": 0.02}], ids=ids)
def test_dist_async_applies_each_encoded_push_as_it_arrives(params):
    run_inproc_ok([str(HERE / "dist_scripts" / "codec_rounds.py"), "dist_async", json.dumps(params)], 2, 2,
                  {"PSLAUNCH_BIGARRAY_BOUND": "100000"})


@pytest.mark.parametrize("params", [{"type": "bf16", "error_feedback": True}, {"type": "1bit_scaled", "block": 256},
                                    {"type": "randomk", "ratio": 0.02}, {"type": "2bit", "threshold": 0.5}], ids=ids)
@pytest.mark.timeout(120)
def test_the_allreduce_store_gathers_every_workers_encoding_and_every_worker_sums_them_alike(params):
    run_job_ok([str(HERE / "dist_scripts" / "codec_sums.py"), json.dumps(params)], 3, 0, {}, 90)


def test_the_device_store_encodes_each_devices_value_with_its_own_residual():
    kv = kvcore.create("device")
    kv.set_gradient_compression({"type": "topk", "ratio": 0.1})
    kv.init("w", np.zeros(100, np.float32))
    rng = np.random.default_rng(0)
    schemes = [SparseScheme("topk", 0.1) for _ in range(2)]
    residuals = [np.zeros(100, np.float32) for _ in range(2)]
    for _ in range(3):
        values = [rng.standard_normal(100).astype(np.float32) for _ in range(2)]
        kv.push("w", values)
        want = schemes[0].decode(schemes[0].encode(values[0], residuals[0]), size=100)
        want += schemes[1].decode(schemes[1].encode(values[1], residuals[1]), size=100)
        out = np.empty(100, np.float32)
        kv.pull("w", out=out)
        assert out.tobytes() == want.tobytes()


def test_a_single_value_on_the_device_store_travels_at_half_width_too():
    kv = kvcore.create("device")
    kv.set_gradient_compression({"type": "fp16"})
    kv.init(0, np.zeros(3, np.float32))
    kv.push(0, np.array([1 + 2**-12, 70000, -0.1], np.float32))
    out = np.empty(3, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == HalfScheme("fp16").decode(HalfScheme("fp16").encode(
        np.array([1 + 2**-12, 70000, -0.1], np.float32)), size=3).tolist() == [1.0, float("inf"), np.float16(-0.1)]


@pytest.mark.parametrize("params, words", [
    ({"type": "topk", "ratio": 0}, "'ratio' is the fraction of values sent, in \\(0, 1\\], got 0"),
    ({"type": "topk", "ratio": "0.1"}, "got '0.1'"),
    ({"type": "randomk", "seed": -1}, "'seed' is an integer of at least 0, got -1"),
    ({"type": "1bit_scaled", "block": 2.5}, "'block' is a count of values per scale .* got 2.5"),
    ({"type": "fp16", "threshold": 0.5}, "fp16 compression takes 'error_feedback', 'pull', not 'threshold'"),
    ({"type": "topk", "ratios": 0.1}, "topk compression takes 'error_feedback', 'pull', 'ratio', 'momentum', not 'ratios'"),
    ({"type": "bf16", "error_feedback": 1}, "'error_feedback' is True or False, got 1"),
    ({"type": "bf16", "pull": "half"}, "'pull' is one of float32, fp16, bf16, got 'half'"),
    ({"type": "2bit", "pull": "int8"}, "'pull' is one of float32, fp16, bf16, got 'int8'"),
    ({"type": "fp8"}, "Unknown type for gradient compression fp8 \\(known types: 2bit, 1bit, fp16, bf16, 1bit_scaled, "
                      "topk, randomk\\)"),
])
def test_bad_parameters_of_the_new_types_are_refused_naming_the_key_and_value(params, words):
    with pytest.raises(kvcore.CompressionError, match=words):
        parse_params(params)
    with pytest.raises(kvcore.CompressionError, match=words):
        kvcore.create("device").set_gradient_compression(params)


def test_the_defaults_of_each_type():
    assert parse_params({"type": "fp16"}).pull == "fp16" and not parse_params({"type": "fp16"}).error_feedback
    assert parse_params({"type": "bf16", "pull": "float32"}).pull is None
    topk = parse_params({"type": "topk"})
    assert (topk.ratio, topk.error_feedback, topk.pull) == (0.01, True, None)
    assert parse_params({"type": "1bit_scaled"}).block == 0
    assert parse_params({"type": "2bit", "anything": 1}).pull is None  # MXNet's types ignore other keys, as MXNet does


def test_a_local_store_refuses_compression_and_names_the_stores_that_take_it():
    with pytest.raises(kvcore.CompressionError, match="use 'device', 'allreduce' or a dist_\\* store"):
        kvcore.create("local").set_gradient_compression({"type": "fp16"})


def test_the_trainer_takes_compression_by_name_or_dict_but_not_twice():
    params = {"w": np.zeros(4, np.float32)}
    trainer = kvcore.Trainer(params, "sgd", kvstore="device", compression="bf16")
    assert trainer._kv._compression.params.type == "bf16"
    with pytest.raises(ValueError, match="give the gradient compression once"):
        kvcore.Trainer(params, "sgd", kvstore="device", compression="fp16", compression_params={"type": "2bit"})
    with pytest.raises(kvcore.DTypeMismatchError, match="only supported for float32 parameters"):
        kvcore.Trainer({"i": np.zeros(4, np.int32)}, "sgd", kvstore="device", compression={"type": "topk"})


def test_momentum_correction_encodes_each_slots_velocity_and_clears_what_topk_sent():
    from kvcore.compression import GradientCompression

    compression = GradientCompression(parse_params({"type": "topk", "ratio": 0.25, "momentum": 0.5}))
    grads = [np.array([4, 1, 0, -2], np.float32), np.array([0, 1, 1, 1], np.float32)]
    scheme = SparseScheme("topk", 0.25)
    velocity, residual = np.zeros(4, np.float32), np.zeros(4, np.float32)
    for grad in grads:  # u = 0.5 u + g; encode u with the residual; the sent index's velocity restarts
        velocity = np.float32(0.5) * velocity + grad
        want = scheme.encode(velocity, residual)
        velocity[want[:4].view(np.uint32)] = 0
        assert compression.quantize("k", grad).tobytes() == want.tobytes()
    # the first push sends index 0 (4); the second: velocity [0, 1.5, 1, 0] + residual [0, 1, 0, -2]
    assert want[:4].view(np.uint32).tolist() == [1] and want[4:].view(np.float32).tolist() == [2.5]


def test_momentum_correction_on_a_dense_codec_keeps_the_whole_velocity():
    from kvcore.compression import GradientCompression

    compression = GradientCompression(parse_params({"type": "1bit_scaled", "momentum": 0.9}))
    scheme = ScaledSignScheme(0)
    grad = np.array([1, -3, 0.5, 2], np.float32)
    velocity, residual = np.zeros(4, np.float32), np.zeros(4, np.float32)
    for _ in range(3):
        velocity = np.float32(0.9) * velocity + grad
        assert compression.quantize(0, grad).tobytes() == scheme.encode(velocity, residual).tobytes()


@pytest.mark.parametrize("params, words", [
    ({"type": "topk", "momentum": 1}, "'momentum' is in \\[0, 1\\), got 1"),
    ({"type": "fp16", "momentum": 0.9}, "fp16 compression takes 'error_feedback', 'pull', not 'momentum'"),
    ({"type": "1bit_scaled", "momentum": 0.9, "error_feedback": False}, "'momentum' needs error feedback"),
])
def test_momentum_correction_is_refused_where_it_cannot_apply(params, words):
    with pytest.raises(kvcore.CompressionError, match=words):
        parse_params(params)
