"""The array-backend helpers the shared model added to kvcore.arrays, on their CPU paths.

The CUDA paths of the same helpers run in test_shared_model_gpu.py when a GPU is present.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest

from kvcore import arrays

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_current_device_follows_nested_device_contexts_per_thread():
    assert arrays.current_device() == arrays.cpu()
    seen = []
    with arrays.device_context(arrays.Device("cpu", 2)):
        with arrays.device_context(arrays.Device("cpu", 5)):
            seen.append(arrays.current_device())
            other = threading.Thread(target=lambda: seen.append(arrays.current_device()))
            other.start()
            other.join()
        seen.append(arrays.current_device())
    seen.append(arrays.current_device())
    assert seen == [arrays.Device("cpu", 5), arrays.cpu(), arrays.Device("cpu", 2), arrays.cpu()]


def test_cpu_paths_of_the_stream_helpers_are_no_ops():
    data = np.arange(6, dtype=np.float32)
    assert arrays.new_stream(arrays.cpu()) is None
    assert arrays.record_event(data) is None
    arrays.wait_event(None)
    arrays.synchronize_stream(arrays.cpu())
    with arrays.stream_context(None):
        pass


def test_pinned_empty_and_peer_copy_fall_back_to_numpy_on_the_cpu():
    buffer = arrays.pinned_empty((2, 3), np.float64)
    assert buffer.shape == (2, 3) and buffer.dtype == np.float64
    source = np.arange(6, dtype=np.float64).reshape(2, 3)
    arrays.peer_copy(buffer, source)
    np.testing.assert_array_equal(buffer, source)
    assert arrays.pinned_empty(4).shape == (4,)


def test_no_shared_model_module_imports_cupy():
    # only psnode/devices/__init__.py (kvcore.arrays) may import cupy (lazily); everything else goes through it
    for path in (ROOT / "kvcore" / "shared_model").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+cupy", text, re.M), path
