"""The shared model where its arrays live on GPUs: stream order, NCCL discipline, pull targets.

Tests parametrized by ``kind`` run their CPU form (CPU slots, numpy) everywhere and their GPU form
with a GPU; the others need one GPU, or two where the name says so, and skip cleanly otherwise.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kvcore import arrays
from kvcore.shared_model import KeyShapeError, SumUpdater, create_shared_model
from kvcore.shared_model.errors import ConfigError

from kvcore_testkit import (
    DEVICE_KINDS,
    default_stream_busy,
    finish_default_stream,
    gpu_ids,
    gpu_test,
    keep_default_stream_busy,
    run_device_threads,
)

pytestmark = pytest.mark.unit


def _devids(kind: str) -> list[int]:
    """Every GPU for the GPU form (one is enough), three CPU slots for the CPU form."""
    return list(range(arrays.num_gpus())) if kind == "gpu" else [0, 1, 2]


def _xp(kind: str):
    return arrays.cupy_module() if kind == "gpu" else np


# ---- sums and rounds ---------------------------------------------------------------------------
@gpu_test
@pytest.mark.parametrize("count,nccl", [(1, "auto"), (2, "auto"), (2, "on"), (2, "off")])
def test_gpu_sum_is_exact_and_callback_runs_with_the_gpu_current(count, nccl):
    devids = gpu_ids(count)
    cp = arrays.cupy_module()
    seen = {}
    if nccl == "on" and not arrays.nccl_available():
        pytest.skip("NCCL is not usable here (the gpu extra installs nvidia-nccl-cu12)")
    with create_shared_model("local", device="gpu", nccl=nccl, timeout=30) as model:
        model.init(devids)

        def device(devid):
            dev = arrays.gpu(devid)
            with arrays.device_context(dev):
                model.init_key((1000, 33), "w", devid)
                for step in range(5):
                    grad = cp.full((1000, 33), devid + step, dtype=cp.float32)
                    model.push(grad, "w", devid)

                    def callback(devid=devid, grad=grad):
                        seen[devid] = (arrays.current_device(), cp.cuda.Device().id, float(grad[0, 0]))

                    model.pull_req(grad, "w", devid, callback=callback)
                    model.pull_wait("w", devid)
                    expected = sum(devids) + step * count
                    assert isinstance(grad, cp.ndarray) and grad.device.id == devid
                    np.testing.assert_array_equal(cp.asnumpy(grad), np.full((1000, 33), expected, np.float32))

        run_device_threads(device, devids, join_timeout=60)
        used_nccl = model.nccl_allreduces > 0
    for devid in devids:
        current, cuda_id, value = seen[devid]
        assert current == arrays.gpu(devid) and cuda_id == devid
        assert value == sum(devids) + 4 * count
    assert used_nccl == (count > 1 and nccl != "off" and arrays.nccl_available())


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_keys_of_several_dtypes_pushed_with_random_priorities_sum_exactly_every_round(kind):
    # Priorities reorder each device's keys differently, so rounds of several keys complete at
    # once on different push threads: with several GPUs, concurrent NCCL all-reduces (float32,
    # uint32, float64) and sums at the first GPU for what NCCL lacks (int16).
    devids = _devids(kind)
    xp = _xp(kind)
    keys = {"f32": np.float32, "u32": np.uint32, "i16": np.int16, "f64": np.float64, "f32b": np.float32}
    shapes = {"f32": (300, 7), "u32": (1000,), "i16": (17, 3), "f64": (64, 64), "f32b": (5,)}
    rounds = 6
    wrong = []
    with create_shared_model("local", device=kind, timeout=60) as model:
        model.init(devids)

        def device(devid):
            rng = np.random.default_rng(devid)
            with arrays.device_context(model.device(devid)):
                for key, dtype in keys.items():
                    model.init_key(shapes[key], key, devid, dtype=dtype)
                bufs = {key: xp.empty(shapes[key], dtype) for key, dtype in keys.items()}
                for r in range(rounds):
                    for key in rng.permutation(list(keys)):
                        bufs[key].fill(10 * r + devid + 1)
                        model.push(bufs[key], key, devid, priority=int(rng.integers(-5, 6)))
                        model.pull_req(bufs[key], key, devid, priority=int(rng.integers(-5, 6)))
                    for key in rng.permutation(list(keys)):
                        model.pull_wait(key, devid)
                        expected = sum(10 * r + d + 1 for d in devids)
                        got = arrays.asnumpy(bufs[key])
                        if not (got == expected).all():
                            wrong.append((devid, r, key, got.ravel()[0].item(), expected))

        run_device_threads(device, devids, join_timeout=90)
    assert wrong == []


# ---- stream order ---------------------------------------------------------------------------------
@gpu_test
@pytest.mark.parametrize("update_on_server,nccl", [(0, "auto"), (1, "auto"), (0, "off")])
def test_a_busy_default_stream_holds_up_neither_the_copies_nor_the_sum_nor_the_update(update_on_server, nccl):
    # The training thread queued work for seconds on its default stream after it pushed and asked
    # for the pull: the model's copies, sum and update do not wait for that work.
    devids = list(range(arrays.num_gpus()))
    cp = arrays.cupy_module()
    updater = SumUpdater() if update_on_server else None
    shape = (512, 256)
    with create_shared_model("local", updater=updater, update_on_server=update_on_server, device="gpu",
                             nccl=nccl, timeout=60) as model:
        model.init(devids)
        grads, outs = {}, {}
        for devid in devids:
            with arrays.device_context(arrays.gpu(devid)):
                model.init_key(shape, "g", devid)
                grads[devid] = cp.full(shape, devid + 1, cp.float32)
                outs[devid] = cp.zeros(shape, cp.float32)

        def round_trip():
            for devid in devids:
                model.push(grads[devid], "g", devid)
                model.pull_req(outs[devid], "g", devid)

        round_trip()  # a first round compiles every kernel the model uses (loading one may synchronise)
        for devid in devids:
            model.pull_wait("g", devid)
        round_trip()
        for devid in devids:
            keep_default_stream_busy(arrays.gpu(devid), 4.0)
        for devid in devids:
            model.pull_wait("g", devid)
        busy = [default_stream_busy(arrays.gpu(devid)) for devid in devids]
        for devid in devids:
            finish_default_stream(arrays.gpu(devid))
        total = sum(d + 1 for d in devids)
        for devid in devids:
            expected = 2 * total if update_on_server else total
            np.testing.assert_array_equal(cp.asnumpy(outs[devid]), np.full(shape, expected, np.float32))
    assert all(busy), f"pull_wait returned only after the default streams finished: busy={busy}"


@gpu_test
@pytest.mark.parametrize("update_on_server", [0, 1])
def test_push_and_pull_wait_for_the_fill_their_arrays_got_behind_busy_work(update_on_server):
    # overlap_mlp.py's start: weights made with zeros and at once pulled. The fill queues behind the
    # busy stream; the pull's copy runs on another stream and must land after it, as must the push's.
    devids = list(range(arrays.num_gpus()))
    cp = arrays.cupy_module()
    updater = SumUpdater() if update_on_server else None
    shape = (1000, 100)
    with create_shared_model("local", updater=updater, update_on_server=update_on_server, device="gpu",
                             timeout=60) as model:
        model.init(devids)
        outs = {}
        for devid in devids:
            with arrays.device_context(arrays.gpu(devid)):
                model.init_key(shape, "w", devid)
                if update_on_server:  # the starting weights (zeros) are published: pull them
                    keep_default_stream_busy(arrays.gpu(devid), 0.5)
                    start = cp.full(shape, -1, cp.float32)  # still queued behind the spin at pull_req
                    model.pull_req(start, "w", devid)
                    model.pull_wait("w", devid)
                    assert float(abs(start).max()) == 0, "the pull landed before the caller's fill"
        for devid in devids:
            with arrays.device_context(arrays.gpu(devid)):
                keep_default_stream_busy(arrays.gpu(devid), 0.5)
                grad = cp.full(shape, devid + 1, cp.float32)  # queued behind the spin
                model.push(grad, "w", devid)
                outs[devid] = cp.zeros(shape, cp.float32)
                model.pull_req(outs[devid], "w", devid)
        total = sum(d + 1 for d in devids)
        for devid in devids:
            model.pull_wait("w", devid)
            np.testing.assert_array_equal(cp.asnumpy(outs[devid]), np.full(shape, total, np.float32))


# ---- pull targets ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_pulls_into_strided_and_host_targets_get_exact_results(kind):
    devids = _devids(kind)
    xp = _xp(kind)
    with create_shared_model("local", device=kind, timeout=30) as model:
        model.init(devids)

        def device(devid):
            with arrays.device_context(model.device(devid)):
                model.init_key((8, 5), "w", devid)
                model.init_key((4, 3), "b", devid)
                wide = xp.full((8, 10), -1, xp.float32)
                host = np.full((4, 3), -1, np.float32)  # a host target of a GPU model
                for step in range(3):
                    model.push(xp.full((8, 5), devid + step, xp.float32), "w", devid)
                    model.push(np.full((4, 3), devid + step, np.float32), "b", devid)
                    model.pull_req(wide[:, ::2], "w", devid)
                    model.pull_req(host, "b", devid)
                    model.pull_wait("w", devid)
                    model.pull_wait("b", devid)
                    expected = sum(devids) + step * len(devids)
                    np.testing.assert_array_equal(arrays.asnumpy(wide[:, ::2]), np.full((8, 5), expected))
                    np.testing.assert_array_equal(arrays.asnumpy(wide[:, 1::2]), np.full((8, 5), -1))
                    np.testing.assert_array_equal(host, np.full((4, 3), expected))

        run_device_threads(device, devids, join_timeout=60)


@gpu_test
def test_an_array_on_another_gpu_is_refused_naming_both_devices():
    devids = gpu_ids(2)
    cp = arrays.cupy_module()
    with create_shared_model("local", device="gpu", timeout=30) as model:
        model.init(devids)
        for devid in devids:
            model.init_key((4,), "w", devid)
        with arrays.device_context(arrays.gpu(1)):
            elsewhere = cp.zeros(4, cp.float32)
        with pytest.raises(KeyShapeError, match=r"pull_req of key 'w' on device 0: the array lives on gpu\(1\), not on gpu\(0\)"):
            model.pull_req(elsewhere, "w", 0)
        with pytest.raises(KeyShapeError, match=r"push of key 'w' on device 0: the array lives on gpu\(1\)"):
            model.push(elsewhere, "w", 0)


@gpu_test
def test_gpu_update_on_server_keeps_weights_on_the_first_gpu():
    devids = gpu_ids(1)
    cp = arrays.cupy_module()
    with create_shared_model("local", updater=SumUpdater(), update_on_server=1, device="gpu", timeout=30) as model:
        model.init(devids)
        model.init_key((64,), 0, 0)
        weights = cp.zeros(64, cp.float32)
        for _ in range(3):
            model.push(cp.ones(64, cp.float32), 0, 0)
            model.pull_req(weights, 0, 0)
            model.pull_wait(0, 0)
        np.testing.assert_array_equal(cp.asnumpy(weights), np.full(64, 3, np.float32))
        model.check_weight(weights, 0, 0)


@gpu_test
def test_gpu_gather_collects_rows_on_the_first_gpu():
    devids = gpu_ids(2)
    cp = arrays.cupy_module()
    with create_shared_model("local", device="gpu", timeout=30, push_op={5: "gather"}) as model:
        model.init(devids)
        out = {}

        def device(devid):
            with arrays.device_context(arrays.gpu(devid)):
                model.init_key((3,), 5, devid)
                model.push(cp.full(3, devid, cp.float32), 5, devid)
                out[devid] = cp.zeros(6, cp.float32)
                model.pull_req(out[devid], 5, devid)
                model.pull_wait(5, devid)

        run_device_threads(device, devids, join_timeout=60)
    for devid in devids:
        np.testing.assert_array_equal(cp.asnumpy(out[devid]), [0, 0, 0, 1, 1, 1])


# ---- NCCL start-up --------------------------------------------------------------------------------
class _FailingNcclGroup:
    """Plays an NCCL whose communicators cannot be created (as ncclCommInitAll fails on a bad topology)."""

    def __init__(self, ids):
        raise RuntimeError(f"NCCL could not create communicators for GPUs {ids}: NcclError: NCCL_ERROR_SYSTEM_ERROR")


@gpu_test
def test_an_nccl_start_failure_falls_back_to_sums_at_the_first_gpu_under_auto_and_fails_under_on(monkeypatch):
    devids = gpu_ids(2)
    if not arrays.nccl_available():
        pytest.skip("NCCL is not usable here (the gpu extra installs nvidia-nccl-cu12)")
    monkeypatch.setattr(arrays, "NcclGroup", _FailingNcclGroup)
    with pytest.raises(ConfigError, match=r"set_param\('nccl', 'on'\) was given, but NCCL could not create communicators"):
        create_shared_model("local", device="gpu", nccl="on").init(devids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with create_shared_model("local", device="gpu", nccl="auto", timeout=30) as model:
            model.init(devids)
            cp = arrays.cupy_module()
            outs = {}
            for devid in devids:
                with arrays.device_context(arrays.gpu(devid)):
                    model.init_key((10,), "w", devid)
                    model.push(cp.full(10, devid + 1, cp.float32), "w", devid)
                    outs[devid] = cp.zeros(10, cp.float32)
                    model.pull_req(outs[devid], "w", devid)
            for devid in devids:
                model.pull_wait("w", devid)
                np.testing.assert_array_equal(cp.asnumpy(outs[devid]), np.full(10, sum(d + 1 for d in devids)))
            assert model.nccl_allreduces == 0
    assert any("peer copies instead" in str(w.message) for w in caught), [str(w.message) for w in caught]

