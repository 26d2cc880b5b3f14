"""kvcore.arrays on GPUs: the probe, copies that have finished when they return (any layout, any
pair of devices), and the NCCL group's discipline. Skipped without a GPU that runs kernels; the
CPU paths of the same helpers are tested in tests/psnode/test_devices.py."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from kvcore import arrays

from kvcore_testkit import default_stream_busy, gpu_ids, keep_default_stream_busy, needs_gpu, run_device_threads

pytestmark = [*needs_gpu, pytest.mark.unit]


def _cp():
    return arrays.cupy_module()


def test_the_probe_ran_kernels_on_every_gpu():
    assert re.fullmatch(r"CuPy \S+ runs kernels on \d+ GPU\(s\)", arrays.gpu_status()), arrays.gpu_status()
    assert arrays.num_gpus() == _cp().cuda.runtime.getDeviceCount() >= 1


@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed"])
def test_copy_into_uploads_into_any_gpu_layout_and_downloads_into_any_host_layout(layout):
    cp = _cp()
    base = cp.zeros((6, 8), cp.float64)
    dst = {"contiguous": base, "strided": base[:, ::2], "transposed": base.T}[layout]
    src = np.arange(dst.size, dtype=np.float32).reshape(dst.shape)
    arrays.copy_into(dst, src)  # ndarray.set alone refuses a non-contiguous destination
    np.testing.assert_array_equal(cp.asnumpy(dst), src)
    host = np.zeros((dst.shape[0], 2 * dst.shape[1]), np.float32)[:, ::2]
    arrays.copy_into(host, dst)
    np.testing.assert_array_equal(host, src)


def test_copy_into_a_gpu_has_finished_when_it_returns_though_its_stream_was_busy():
    device = arrays.gpu(0)
    source = arrays.pinned_empty((1 << 20,), np.float32)  # from pinned memory the upload is asynchronous
    source[...] = 7
    target = arrays.zeros((1 << 20,), np.float32, device)
    keep_default_stream_busy(device, 0.5)  # the upload queues behind this
    arrays.copy_into(target, source)
    assert not default_stream_busy(device)
    source[...] = -1  # too late to change what landed
    assert float(target.min()) == float(target.max()) == 7


def test_copy_into_the_host_reads_after_the_work_queued_on_the_source():
    device = arrays.gpu(0)
    cp = _cp()
    with arrays.device_context(device):
        keep_default_stream_busy(device, 0.3)
        source = cp.full((1 << 20,), 5, cp.float32)  # filled behind the spinning kernel
        target = np.zeros((1 << 20,), np.float32)
        arrays.copy_into(target, source)
    assert target.min() == target.max() == 5


def test_copy_into_between_two_gpus_any_layout_whichever_gpu_is_current():
    first, second = (arrays.gpu(i) for i in gpu_ids(2))
    cp = _cp()
    with arrays.device_context(second):
        src = cp.arange(48, dtype=cp.float32).reshape(6, 8)[:, ::2]
    with arrays.device_context(first):
        dst = cp.zeros((8, 12), cp.float64)[1:7, ::3]
    for current in (first, second):
        with arrays.device_context(first):
            dst.fill(0)
        with arrays.device_context(current):
            arrays.copy_into(dst, src)
        np.testing.assert_array_equal(cp.asnumpy(dst), cp.asnumpy(src))
        assert arrays.device_of(dst) == first


def _nccl_group(ids):
    if not arrays.nccl_available():
        pytest.skip("NCCL is not usable here (the gpu extra installs nvidia-nccl-cu12)")
    return arrays.NcclGroup(ids)


_NCCL_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "uint32", "int64", "uint64"]


def test_an_nccl_group_of_one_gpu_reduces_every_nccl_dtype_from_several_threads_at_once():
    cp = _cp()
    group = _nccl_group([0])
    try:
        rounds = 10

        def run(dtype):
            with arrays.device_context(arrays.gpu(0)):
                buf = cp.arange(1000).astype(dtype)
                arrays.synchronize_stream(arrays.gpu(0))
                for _ in range(rounds):
                    group.allreduce_sum([buf])  # one GPU: the sum is the buffer itself
                assert cp.asnumpy(buf).tolist() == np.arange(1000).astype(dtype).tolist()

        run_device_threads(run, _NCCL_DTYPES, join_timeout=60)
        assert group.allreduces == rounds * len(_NCCL_DTYPES)
        with arrays.device_context(arrays.gpu(0)):
            with pytest.raises(TypeError, match="NCCL cannot reduce dtype int16"):
                group.allreduce_sum([cp.zeros(4, cp.int16)])
            with pytest.raises(ValueError, match="buffer 0 of the NCCL all-reduce is not contiguous"):
                group.allreduce_sum([cp.zeros(8, cp.float32)[::2]])
    finally:
        group.close()
    with pytest.raises(RuntimeError, match=r"GPUs \[0\] was closed"):
        group.allreduce_sum([arrays.zeros(4, np.float32, arrays.gpu(0))])


def test_an_nccl_group_sums_all_reduces_that_threads_issue_in_differing_orders():
    gpu_ids(2)
    ids = list(range(arrays.num_gpus()))
    cp = _cp()
    group = _nccl_group(ids)
    expected = sum(i + 1 for i in ids)
    try:

        def run(thread):
            rng = random.Random(thread)
            keys = {}
            for k in range(4):
                keys[k] = []
                for i in ids:
                    with arrays.device_context(arrays.gpu(i)):
                        keys[k].append(cp.empty(10_000 + 1000 * k, cp.float32))
            for _ in range(8):
                order = list(keys)
                rng.shuffle(order)  # every thread reduces its keys in another order
                for k in order:
                    for i, buf in zip(ids, keys[k]):
                        with arrays.device_context(arrays.gpu(i)):
                            buf.fill(i + 1)
                            arrays.synchronize_stream(arrays.gpu(i))  # the group waits for no other stream
                    group.allreduce_sum(keys[k])
                    for buf in keys[k]:
                        with arrays.device_context(arrays.device_of(buf)):
                            assert float(buf.min()) == float(buf.max()) == expected

        run_device_threads(run, [0, 1, 2], join_timeout=90)
    finally:
        group.close()


def test_to_device_and_asnumpy_from_another_gpu_read_after_the_work_queued_there():
    first, second = (arrays.gpu(i) for i in gpu_ids(2))
    cp = _cp()
    with arrays.device_context(second):
        keep_default_stream_busy(second, 0.3)
        source = cp.full((1 << 20,), 5, cp.float32)  # filled behind the spinning kernel on the second GPU
    with arrays.device_context(first):  # the first GPU current: CuPy alone would use its stream
        placed = arrays.to_device(source, first)
        host = arrays.asnumpy(source)
    assert arrays.device_of(placed) == first
    assert float(arrays.asnumpy(placed).min()) == 5 and host.min() == host.max() == 5
