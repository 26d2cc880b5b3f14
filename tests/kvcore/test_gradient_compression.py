"""set_gradient_compression on the device store, and Trainer(compression_params=...), with MXNet's numbers.

The MXNET_* vectors below were produced by MXNet 1.9.1 (``mx.kv.create('device')``,
``set_gradient_compression``, push, pull) from the inputs ``make_grad`` builds, and frozen here, so
the tests need no MXNet: kvcore must pull the very same float32 bits.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcore
from kvcore.compression import parse_threshold
from kvcore.errors import CompressionError, DTypeMismatchError, KVStoreError

from dist_scripts.gradients import digest, make_grad

pytestmark = pytest.mark.unit

F32 = np.float32


def pulled(kv, key, n):
    out = np.full(n, -7, F32)
    kv.pull(key, out=out)
    return out


def device_store(params=None):
    kv = kvcore.create("device")
    kv.set_gradient_compression(params or {"type": "2bit", "threshold": 0.5})
    return kv


# ---- bit for bit with MXNet 1.9.1 ------------------------------------------------------------------

# One value per push, threshold 0.5, four pushes of make_grad(n, 100 * n + step): sha256 of each pull.
MXNET_SINGLE = {
    1: ["df3f619804a92fdb", "c34fde18c1b8ec18", "c34fde18c1b8ec18", "df3f619804a92fdb"],
    15: ["5a68164f16375a40", "336ea57280a286f6", "8d7de966de466747", "84d519f350abdeb3"],
    16: ["73ad63eb6ea0f20d", "4dd35396a5f70fb0", "1fecf461e99df4ed", "600f741569fec5c0"],
    17: ["9075241514d69972", "53a07d76cbeba1ee", "41b85a56359b5d36", "d96b3c9b82c8964f"],
    1_000_003: ["ed6ed1b52487b846", "57ab33fe04708c68", "f81bcf53d21d3965", "df63e83a2a51db55"],
}
MXNET_SINGLE_17 = [  # the same run's pulls of the 17-element key, readable
    [0.5, -0.5, 0, 0, 0, 0, 0, -0.5, 0, 0, 0, 0, -0.5, 0, 0, 0, 0.5],
    [-0.5, 0, 0, 0, 0, 0, -0.5, -0.5, 0, 0.5, 0, 0, 0, 0, 0, 0, 0.5],
    [-0.5, 0, 0, -0.5, -0.5, 0, -0.5, 0, 0, 0, 0, -0.5, 0, 0.5, 0.5, -0.5, 0],
    [-0.5, 0, 0, -0.5, -0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0.5, 0, -0.5, -0.5],
]


@pytest.mark.parametrize("n", sorted(MXNET_SINGLE))
def test_device_store_pulls_mxnets_bits_for_one_value_over_four_pushes(n):
    kv = device_store()
    kv.init(0, np.zeros(n, F32))
    for step, expected in enumerate(MXNET_SINGLE[n]):
        kv.push(0, make_grad(n, 100 * n + step))
        value = pulled(kv, 0, n)
        assert digest(value) == expected, f"size {n}, push {step}"
        if n == 17:
            assert value.tolist() == MXNET_SINGLE_17[step]


# Four values per push (list positions 0-3), make_grad(37, 1000 * step + slot, 3) * 0.3, six pushes,
# the threshold set to 0.07 before the fourth: residuals are kept, the new threshold is used.
MXNET_FOUR_SLOTS = {
    "0.1": ["637f0e5221571b4d", "ce0a9d2f3e2c3a5b", "ca8233963bf563a0", "ca3ff6be6979aca3", "8fb11f248948cf5e",
            "25aa2bbf12f0d441"],
    0.3: ["efbf7764efa3e730", "d04db7b1244694b0", "0debdb4dd9eb72ba", "a8a5365645e444f8", "1940e67768927bc3",
          "df59ad50701776b5"],
}


@pytest.mark.parametrize("threshold", list(MXNET_FOUR_SLOTS))
def test_device_store_with_four_slots_and_a_threshold_change_pulls_mxnets_bits(threshold):
    n = 37
    kv = device_store({"type": "2bit", "threshold": threshold})
    kv.init("w", np.zeros(n, F32))
    for step, expected in enumerate(MXNET_FOUR_SLOTS[threshold]):
        if step == 3:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.07})
        kv.push("w", [make_grad(n, 1000 * step + slot, scale_bits=3) * F32(0.3) for slot in range(4)])
        assert digest(pulled(kv, "w", n)) == expected, f"push {step}"


def test_device_store_with_four_slots_of_a_million_values_pulls_mxnets_bits():
    n = 1_000_003
    kv = device_store({"type": "2bit", "threshold": 0.25})
    kv.init(0, np.zeros(n, F32))
    for step, expected in enumerate(["021695143207f513", "f949912ef7ab8558", "4944588d0833caed"]):
        kv.push(0, [make_grad(n, 7 * step + slot) for slot in range(4)])
        assert digest(pulled(kv, 0, n)) == expected, f"push {step}"


def test_device_store_residual_per_list_position_as_mxnet_keeps_them():
    kv = device_store()
    kv.init(3, np.zeros(4, F32))
    values = [np.array([0.6, -0.6, 0.3, 1.2], F32) for _ in range(4)]
    steps = []
    for _ in range(3):
        kv.push(3, values)
        steps.append(pulled(kv, 3, 4).tolist())
    kv.push(3, values[:2])  # positions 0 and 1 go on with their own residuals
    steps.append(pulled(kv, 3, 4).tolist())
    kv.push(3, values[0])
    steps.append(pulled(kv, 3, 4).tolist())
    # MXNet 1.9.1 pulls exactly these
    assert steps == [[2, -2, 0, 2], [2, -2, 2, 2], [2, -2, 0, 2], [1, -1, 1, 1], [0.5, -0.5, 0.5, 0.5]]


def test_denormal_gradients_accumulate_in_the_residual_as_in_mxnet():
    kv = device_store({"type": "2bit", "threshold": 1.2e-38})
    kv.init(0, np.zeros(4, F32))
    g = np.array([1e-39, 3e-39, -5e-39, 1e-38], F32)
    signs = []
    for _ in range(15):
        kv.push(0, g)
        value = pulled(kv, 0, 4)
        assert set(np.abs(value).tolist()) <= {0.0, float(F32(1.2e-38))}
        signs.append("".join("+" if v > 0 else "-" if v < 0 else "0" for v in value))
    assert signs == ["0000", "000+", "00-+", "0+0+", "00-+", "0000", "000+", "0+-+", "000+", "00-+", "000+",
                     "++00", "00-+", "000+", "00-+"]


# What MXNet 1.9.1's device store dequantizes a code 11 to, for thresholds given these ways.
MXNET_THRESHOLDS = {
    0.5: "3f000000", 0.1: "3dcccccd", "1e-3": "3a83126f", 1.5e-05: "377ba882", 7.374512500957097e-06: "36f77295",
    1.8078399346030392e-07: "34421d86", 2: "40000000", "0.30000000000000004": "3e99999a", 123.456: "42f6e979",
    ".25": "3e800000", "5.": "40a00000",
}


@pytest.mark.parametrize("value", list(MXNET_THRESHOLDS))
def test_thresholds_become_the_float32_mxnet_parses(value):
    assert parse_threshold(value).tobytes()[::-1].hex() == MXNET_THRESHOLDS[value]
    kv = device_store({"type": "2bit", "threshold": value})
    kv.init(0, np.zeros(1, F32))
    kv.push(0, np.array([3e38], F32))
    assert pulled(kv, 0, 1).tobytes()[::-1].hex() == MXNET_THRESHOLDS[value]


def test_mxnets_parser_differs_from_numpy_for_some_thresholds():
    value = 7.374512500957097e-06
    assert parse_threshold(value) != F32(value)  # one float32 step apart: the reason parse_threshold exists


# ---- semantics -------------------------------------------------------------------------------------


def test_a_single_value_is_compressed_too_and_pull_and_init_are_not():
    kv = device_store()
    kv.init(0, np.array([0.3, 0.7], F32))
    assert pulled(kv, 0, 2).tolist() == [F32(0.3), F32(0.7)]  # init is stored as given
    kv.push(0, np.array([0.3, 0.7], F32))
    assert pulled(kv, 0, 2).tolist() == [0.0, 0.5]


def test_the_updater_receives_the_dequantized_sum():
    kv = device_store()
    kv.init("k", np.zeros(3, F32))
    seen = []
    kv.set_updater(lambda key, merged, stored: seen.append((key, merged.tolist())))
    kv.push("k", [np.array([0.5, -0.5, 0.1], F32), np.array([0.5, 0.25, 0.1], F32)])
    assert seen == [("k", [1.0, -0.5, 0.0])]


def test_setting_it_again_changes_the_threshold_and_keeps_the_residual():
    kv = device_store()
    kv.init(0, np.zeros(1, F32))
    kv.push(0, np.array([0.375], F32))
    assert pulled(kv, 0, 1).tolist() == [0.0]  # residual 0.375
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.25})
    kv.push(0, np.array([0.375], F32))
    assert pulled(kv, 0, 1).tolist() == [0.25]  # 0.75 >= 0.25: sends 0.25, keeps 0.5
    kv.push(0, np.array([0.0], F32))
    assert pulled(kv, 0, 1).tolist() == [0.25]


def test_type_alone_means_threshold_one_half_and_extra_keys_are_ignored():
    kv = device_store({"type": "2bit", "compress_the_wire": True, "threshold_v2": -3})
    kv.init(0, np.zeros(1, F32))
    kv.push(0, np.array([0.5], F32))
    assert pulled(kv, 0, 1).tolist() == [0.5]


def test_1bit_on_the_device_store_sends_plus_or_minus_one_per_value():
    kv = device_store({"type": "1bit", "threshold": 0})
    kv.init(0, np.zeros(3, F32))
    kv.push(0, [np.array([0.5, -0.5, 0], F32), np.array([2, 0.25, -3], F32)])
    assert pulled(kv, 0, 3).tolist() == [2, 0, -2]  # (+1) + (+1), (-1) + (+1), (-1) + (-1)


def test_keys_stay_uncompressed_on_a_store_without_compression():
    kv = kvcore.create("device")
    kv.init(0, np.zeros(1, F32))
    kv.push(0, np.array([0.3], F32))
    assert pulled(kv, 0, 1).tolist() == [F32(0.3)]


# ---- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, words",
    [
        ({"type": "2bit", "threshold": 0}, "must be greater than 0, got 0"),
        ({"type": "2bit", "threshold": -1}, "must be greater than 0, got -1"),
        ({"type": "abc", "threshold": -1}, "must be greater than 0"),  # MXNet checks the threshold first
        ({"type": "2bit", "threshold": float("nan")}, "must be a finite number, got nan"),
        ({"type": "2bit", "threshold": float("inf")}, "must be a finite number, got inf"),
        ({"type": "abc"}, "Unknown type for gradient compression abc"),
        ({"type": "none"}, "Unknown type for gradient compression none"),
        ({"type": "2BIT"}, "Unknown type for gradient compression 2BIT"),
        ({"threshold": 0.5}, "no 'type'"),
        ({"type": "2bit", "threshold": "abc"}, "threshold must be a number, got 'abc'"),
        ({"type": "2bit", "threshold": None}, "threshold must be a number, got None"),
        ({"type": "2bit", "threshold": True}, "threshold must be a number, got True"),
        ({"type": "2bit", "threshold": " 0.5 "}, "threshold must be a number, got ' 0.5 '"),
        ({"type": "2bit", "threshold": "1e-39"}, "'1e-39' is out of float32's range"),
        ([("type", "2bit")], "must be a dict .* got list"),
    ],
)
def test_bad_parameters_raise_compression_error_naming_them(params, words):
    kv = kvcore.create("device")
    with pytest.raises(CompressionError, match=words) as info:
        kv.set_gradient_compression(params)
    assert isinstance(info.value, KVStoreError) and isinstance(info.value, ValueError)


def test_the_local_store_refuses_compression_as_mxnet_does():
    with pytest.raises(CompressionError, match="Gradient compression is not supported for this type of kvstore"):
        kvcore.create("local").set_gradient_compression({"type": "2bit"})


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_a_push_that_is_not_float32_is_refused_with_compression_on(dtype):
    kv = device_store()
    kv.init(5, np.zeros(3, dtype))
    with pytest.raises(DTypeMismatchError, match=f"only supported for float32 .* key 5 holds {np.dtype(dtype)}"):
        kv.push(5, np.ones(3, dtype))
    out = np.full(3, 9, dtype)
    kv.pull(5, out=out)  # nothing was pushed, and pulls of the key still work
    assert out.tolist() == [0, 0, 0]


def test_1bit_accepts_a_threshold_of_zero_or_below():
    kvcore.create("device").set_gradient_compression({"type": "1bit", "threshold": -0.5})


# ---- Trainer ---------------------------------------------------------------------------------------


def test_trainer_compression_params_push_quantized_gradients():
    w = [np.zeros(4, F32), np.zeros(4, F32)]  # two replicas
    trainer = kvcore.Trainer({"w": w}, kvcore.optim.SGD(learning_rate=1.0), kvstore="device",
                             compression_params={"type": "2bit", "threshold": 0.5})
    grads = [np.array([0.75, -0.75, 0.25, 0.0], F32), np.array([0.75, 0.25, 0.25, -0.5], F32)]
    trainer.step(1, {"w": [g.copy() for g in grads]})
    # each replica's gradient is quantized on its own: [0.5, -0.5, 0, 0] + [0.5, 0, 0, -0.5]
    assert w[0].tolist() == w[1].tolist() == [-1.0, 0.5, 0.0, 0.5]
    trainer.step(1, {"w": [g.copy() for g in grads]})
    # residuals plus gradients, [1, -1, .5, 0] and [1, .5, .5, -.5], send [.5, -.5, .5, 0] + [.5, .5, .5, -.5]
    assert w[0].tolist() == w[1].tolist() == [-2.0, 0.5, -1.0, 1.0]


def test_trainer_refuses_compression_for_float16_parameters_naming_them():
    with pytest.raises(DTypeMismatchError, match=r"only supported for float32 parameters.*'h' \(float16\)"):
        kvcore.Trainer({"w": np.zeros(2, F32), "h": np.zeros(2, np.float16)}, "sgd", kvstore="device",
                       compression_params={"type": "2bit"})


def test_trainer_checks_compression_params_before_any_step():
    with pytest.raises(CompressionError, match="Unknown type for gradient compression 3bit"):
        kvcore.Trainer([np.zeros(2, F32)], "sgd", kvstore="device", compression_params={"type": "3bit"})
    with pytest.raises(CompressionError, match=r"not supported for this type of kvstore \('local'\)"):
        kvcore.Trainer([np.zeros(2, F32)], "sgd", compression_params={"type": "2bit"})
