"""The shared model's CuPy path: Level-1 sums on GPUs, callbacks with the GPU current.

Skipped without a usable GPU. With one GPU the single-device path runs; with two or more, the
multi-GPU sum (NCCL when usable, else peer copies) runs too.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcore import arrays
from kvcore.shared_model import SumUpdater, create_shared_model

from kvcore_testkit import run_device_threads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not arrays.gpu_available(), reason="needs a CUDA GPU with a working CuPy"),
]


def _gpu_ids(count):
    if arrays.num_gpus() < count:
        pytest.skip(f"needs {count} GPUs, found {arrays.num_gpus()}")
    return list(range(count))


@pytest.mark.parametrize("count,nccl", [(1, "auto"), (2, "auto"), (2, "off")])
def test_gpu_sum_is_exact_and_callback_runs_with_the_gpu_current(count, nccl):
    devids = _gpu_ids(count)
    cp = arrays.cupy_module()
    seen = {}
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
    for devid in devids:
        current, cuda_id, value = seen[devid]
        assert current == arrays.gpu(devid) and cuda_id == devid
        assert value == sum(devids) + 4 * count


def test_gpu_update_on_server_keeps_weights_on_the_first_gpu():
    devids = _gpu_ids(1)
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


def test_gpu_gather_collects_rows_on_the_first_gpu():
    devids = _gpu_ids(2)
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
