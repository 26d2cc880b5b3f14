"""Level 2's bridge logic against kvcore's in-process store (real processes: test_shared_model_dist.py).

The local store completes every call at once, so these tests pin down the bridge's bookkeeping:
only Level-1 results are pushed, pulls wait for the store's answer, the server-side updater runs
once per round and the model's rounds stay exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvcore_testkit import run_device_threads

from kvcore.shared_model import ConfigError, SharedModel, SumUpdater

pytestmark = pytest.mark.unit


def _store_and_count():
    from kvcore.stores.local import LocalKVStore

    class Counting(LocalKVStore):
        """The local store, counting what crosses into it."""

        def __init__(self):
            super().__init__("local")
            self.pushes = 0

        def _push_groups(self, groups, priority, copy=True):
            self.pushes += 1
            return super()._push_groups(groups, priority, copy)

    return Counting()


def test_dist_model_pushes_one_level1_result_per_round_and_pulls_updated_weights():
    store = _store_and_count()
    devids = [0, 1, 2]
    model = SharedModel("dist", updater=SumUpdater(), store=store)
    model.set_param("device", "cpu")
    model.set_param("timeout", 10)
    model.init(devids)
    got = {}

    def device(devid):
        model.init_key((4,), "w", devid)
        data = np.zeros(4, np.float32)
        for _ in range(6):
            data[...] = devid + 1
            model.push(data, "w", devid)
            model.pull_req(data, "w", devid)
            model.pull_wait("w", devid)
        got[devid] = data.copy()

    try:
        run_device_threads(device, devids)
        for devid in devids:
            np.testing.assert_array_equal(got[devid], np.full(4, 6 * 6, np.float32))
        assert store.pushes == 6  # one Level-1 sum per round, not one push per device
        np.testing.assert_array_equal(model.get_weight("w", 0), np.full(4, 36, np.float32))
        model.barrier()
    finally:
        model.close()


def test_dist_model_refuses_gather():
    model = SharedModel("dist", updater=SumUpdater(), store=_store_and_count())
    model.set_param("push_op[1]", "gather")
    with pytest.raises(ConfigError, match=r"push_op 'gather' is only supported by a 'local' model; keys \[1\]"):
        model.init([0])
