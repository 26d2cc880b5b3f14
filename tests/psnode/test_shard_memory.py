"""Where a server keeps its shards: host memory and a GPU answer the round machine's operations alike."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from psnode import devices
from psnode.server.shard_memory import GpuMemory, HostMemory, shard_memory

pytestmark = pytest.mark.unit

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not devices.gpu_available(), reason=f"needs a CUDA GPU: {devices.gpu_status()}")]


@pytest.mark.parametrize("spec", ["cpu", pytest.param("gpu", marks=ON_GPU)])
def test_both_memories_place_load_add_and_answer_rows_and_host_copies_exactly(spec):
    memory = shard_memory(spec)
    assert isinstance(memory, HostMemory if spec == "cpu" else GpuMemory)
    stored = memory.place(np.arange(12, dtype=np.float32))
    merge = memory.empty_like(stored)
    memory.add2(merge, np.ones(12, np.float32), np.full(12, 2, np.float32))
    for _ in range(5):
        memory.add(merge, np.ones(12, np.float32))
    with memory.context():
        stored += merge  # what an updater does with the shard, in place
    np.testing.assert_array_equal(memory.host(stored), np.arange(12) + 8)
    np.testing.assert_array_equal(memory.rows(stored, 3, np.array([3, 0, 3])), [[17, 18, 19], [8, 9, 10], [17, 18, 19]])
    memory.load(merge, np.zeros(12, np.float32))
    np.testing.assert_array_equal(memory.host(merge), np.zeros(12))
    if spec == "gpu":
        assert devices.device_of(stored) == devices.gpu(0)
        assert len(memory._uploads) == 1  # every push of one size reuses one upload buffer


@pytest.mark.skipif(devices.gpu_available(), reason="checks the fallback without a GPU")
def test_a_server_asked_for_a_gpu_without_one_keeps_host_memory_and_says_so():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory = shard_memory("gpu:1")
    assert isinstance(memory, HostMemory)
    assert any("PSLAUNCH_SERVER_DEVICE=gpu:1: no usable GPU 1" in str(w.message) for w in caught)
