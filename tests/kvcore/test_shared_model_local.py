"""The shared model inside one process: Level-1 results, pull/callback semantics, priorities, errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvcore import arrays
from kvcore.shared_model import (
    ConfigError,
    DuplicatePullError,
    KeyNotInitialisedError,
    KeyShapeError,
    ModelUpdater,
    PullFailedError,
    PullTimeoutError,
    StateError,
    SumUpdater,
    UnknownDeviceError,
    WeightMismatchError,
    create_shared_model,
)

from kvcore_testkit import run_device_threads

pytestmark = pytest.mark.unit



def _model_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shared-model-")]


@pytest.fixture
def make_model():
    """Create models on the CPU slots; close them and check that no worker thread is left."""
    made = []

    def make(devices=(0,), kind="local", updater=None, **params):
        params.setdefault("device", "cpu")
        params.setdefault("timeout", 10)
        model = create_shared_model(kind, updater=updater, **params)
        made.append(model)
        model.init(list(devices))
        return model

    yield make
    for model in made:
        model.close()
    assert _model_threads() == []


# ---- results ------------------------------------------------------------------------------------
def test_local_sum_gives_every_device_the_sum_of_all_devices(make_model):
    devids = [0, 1, 2]
    model = make_model(devids)
    results = {}

    def device(devid):
        data = np.zeros((2, 3), np.float32)
        data[0], data[1] = 1, devid
        model.init_key((3,), 0, devid)
        model.init_key((3,), 1, devid)
        model.push(data[0], 0, devid)
        model.pull_req(data[0], 0, devid)
        model.push(data[1], 1, devid)
        model.pull_req(data[1], 1, devid)
        model.pull_wait(0, devid)
        model.pull_wait(1, devid)
        results[devid] = data

    run_device_threads(device, devids)
    for devid in devids:
        np.testing.assert_array_equal(results[devid], [[3, 3, 3], [3, 3, 3]])


@pytest.mark.parametrize("threads", ["ndev", "one"])
def test_many_rounds_give_exact_sums_per_round(make_model, threads):
    devids = [0, 3, 5]
    model = make_model(devids, push_thread=threads, pull_thread=threads)
    rounds = 25
    seen = {d: [] for d in devids}

    def device(devid):
        for key in ("w", "b"):
            model.init_key((4, 2), key, devid, dtype=np.int64)
        grads = {key: np.empty((4, 2), np.int64) for key in ("w", "b")}
        for r in range(rounds):
            for i, key in enumerate(("w", "b")):
                grads[key][...] = r * 100 + devid * 10 + i
                model.push(grads[key], key, devid, priority=i)
                model.pull_req(grads[key], key, devid, priority=i)
            for key in ("w", "b"):
                model.pull_wait(key, devid)
            seen[devid].append((int(grads["w"][0, 0]), int(grads["b"][3, 1])))

    run_device_threads(device, devids)
    expected = [(3 * r * 100 + 10 * sum(devids), 3 * r * 100 + 10 * sum(devids) + 3) for r in range(rounds)]
    for devid in devids:
        assert seen[devid] == expected


def test_gather_stacks_the_devices_pushes_in_init_order(make_model):
    devids = [2, 0, 1]
    model = make_model(devids, **{"push_op[7]": "gather"})
    out = {}

    def device(devid):
        model.init_key((2,), 7, devid)
        model.push(np.full(2, devid, np.float32), 7, devid)
        out[devid] = np.zeros((6,), np.float32)
        model.pull_req(out[devid], 7, devid)
        model.pull_wait(7, devid)

    run_device_threads(device, devids)
    for devid in devids:
        np.testing.assert_array_equal(out[devid], [2, 2, 0, 0, 1, 1])


def test_update_on_server_pulls_weights_from_the_updater(make_model):
    class StartAtTen(SumUpdater):
        def init_model(self, key, data):
            data[...] = 10

    model = make_model([0, 1], update_on_server=1, updater=StartAtTen())
    got = {}

    def device(devid):
        model.init_key((3,), "w", devid)
        weights = np.zeros(3, np.float32)
        model.pull_req(weights, "w", devid)  # no push yet: the starting weights
        model.pull_wait("w", devid)
        got[(devid, 0)] = weights.copy()
        for step in (1, 2):
            model.push(np.full(3, devid + 1, np.float32), "w", devid)
            model.pull_req(weights, "w", devid)
            model.pull_wait("w", devid)
            got[(devid, step)] = weights.copy()
        model.check_weight(weights, "w", devid)

    run_device_threads(device, [0, 1])
    for devid in (0, 1):
        np.testing.assert_array_equal(got[(devid, 0)], [10, 10, 10])
        np.testing.assert_array_equal(got[(devid, 1)], [13, 13, 13])
        np.testing.assert_array_equal(got[(devid, 2)], [16, 16, 16])


def test_check_weight_raises_naming_the_largest_difference(make_model):
    model = make_model([0], update_on_server=1, updater=SumUpdater())
    model.init_key((3,), 4, 0)
    wrong = np.array([0, 0.5, 0], np.float32)
    with pytest.raises(WeightMismatchError, match=r"key=4, dev=0.*0\.5 at index \(1,\) \(0\.5 here, 0\.0 in the model\)"):
        model.check_weight(wrong, 4, 0)


# ---- pull and callback semantics ----------------------------------------------------------------
def test_callback_runs_after_the_data_is_in_place_on_the_pulling_device(make_model):
    devids = [0, 1]
    model = make_model(devids)
    seen = {}

    def device(devid):
        model.init_key((5,), 0, devid)
        data = np.full(5, devid + 1, np.float32)

        def callback():
            seen[devid] = (data.copy(), arrays.current_device(), threading.current_thread().name)

        model.push(data, 0, devid)
        model.pull_req(data, 0, devid, callback=callback)
        model.pull_wait(0, devid)
        assert devid in seen, "pull_wait returned before the callback ran"

    run_device_threads(device, devids)
    for devid in devids:
        values, current, thread = seen[devid]
        np.testing.assert_array_equal(values, np.full(5, 3, np.float32))
        assert current == model.device(devid) == arrays.Device("cpu", devid)
        assert thread == f"shared-model-pull-dev{devid}"


def test_pull_wait_with_nothing_outstanding_returns_at_once(make_model):
    model = make_model([0, 1])
    model.init_key((2,), "k", 0)
    # timeout=0 would raise PullTimeoutError at the first check if pull_wait waited at all
    model.pull_wait("k", 0, timeout=0)


def test_pull_wait_after_a_finished_pull_returns_at_once(make_model):
    model = make_model([0])
    model.init_key((2,), "k", 0)
    data = np.ones(2, np.float32)
    model.push(data, "k", 0)
    model.pull_req(data, "k", 0)
    model.pull_wait("k", 0)
    model.pull_wait("k", 0, timeout=0)
    np.testing.assert_array_equal(data, [1, 1])


def test_pulls_queued_behind_a_busy_pull_thread_run_highest_priority_first(make_model):
    model = make_model([0])
    keys = ["blocker", "a", "b", "c", "d", "e"]
    data = {}
    for key in keys:
        model.init_key((1,), key, 0)
        data[key] = np.zeros(1, np.float32)
        model.push(data[key], key, 0)
        model.pull_req(data[key], key, 0)
    for key in keys:
        model.pull_wait(key, 0)
    # every key now has a published result, so each pull_req below is queued at once

    started, release = threading.Event(), threading.Event()
    order = []

    def block():
        started.set()
        assert release.wait(10)

    model.pull_req(data["blocker"], "blocker", 0, callback=block)
    assert started.wait(10)
    priorities = {"a": 1, "b": 5, "c": -2, "d": 5, "e": 3}
    for key, priority in priorities.items():
        model.pull_req(data[key], key, 0, priority=priority, callback=lambda key=key: order.append(key))
    release.set()
    for key in keys:
        model.pull_wait(key, 0)
    # highest priority first; b and d tie and keep the order they were asked in
    assert order == ["b", "d", "e", "a", "c"]


def test_pull_waits_for_every_device_to_push_the_key(make_model):
    model = make_model([0, 1])
    for devid in (0, 1):
        model.init_key((2,), 9, devid)
    mine = np.ones(2, np.float32)
    model.push(mine, 9, 0)
    model.pull_req(mine, 9, 0)
    with pytest.raises(PullTimeoutError, match=r"key=9, dev=0.*device\(s\) \[1\] have not pushed key 9"):
        model.pull_wait(9, 0, timeout=0.3)
    model.push(np.full(2, 2, np.float32), 9, 1)
    model.pull_wait(9, 0)
    np.testing.assert_array_equal(mine, [3, 3])


def test_callback_error_is_raised_by_pull_wait_naming_key_and_device(make_model):
    model = make_model([0])
    model.init_key((1,), "k", 0)
    data = np.zeros(1, np.float32)
    model.push(data, "k", 0)

    def broken():
        raise RuntimeError("boom")

    model.pull_req(data, "k", 0, callback=broken)
    with pytest.raises(PullFailedError, match=r"key 'k' on device 0: the pull's callback raised RuntimeError: boom"):
        model.pull_wait("k", 0)
    model.pull_wait("k", 0, timeout=0)  # reported once; nothing outstanding any more


# ---- bad input ----------------------------------------------------------------------------------
def test_push_of_a_key_without_init_key_names_key_and_device(make_model):
    model = make_model([0, 1])
    model.init_key((2,), 5, 0)
    with pytest.raises(KeyNotInitialisedError, match=r"push of key 5 on device 1, which has not run init_key\(shape, 5, 1\)"):
        model.push(np.zeros(2, np.float32), 5, 1)
    with pytest.raises(KeyNotInitialisedError, match=r"pull_wait of key 'x' on device 0"):
        model.pull_wait("x", 0)


def test_unknown_device_id_lists_the_models_devices(make_model):
    model = make_model([0, 2])
    with pytest.raises(UnknownDeviceError, match=r"device id 1 was not given to init\(\); the model's devices are \[0, 2\]"):
        model.init_key((2,), 0, 1)


def test_push_of_the_wrong_shape_names_both_shapes(make_model):
    model = make_model([0])
    model.init_key((2, 3), "w", 0)
    with pytest.raises(KeyShapeError, match=r"key 'w' on device 0: the key has shape \(2, 3\), the array has shape \(3, 2\)"):
        model.push(np.zeros((3, 2), np.float32), "w", 0)
    with pytest.raises(KeyShapeError, match=r"dtype float32, the array has dtype float64"):
        model.pull_req(np.zeros((2, 3)), "w", 0)


def test_init_key_with_a_different_shape_on_another_device_names_both(make_model):
    model = make_model([0, 1])
    model.init_key((4,), 1, 0)
    with pytest.raises(KeyShapeError, match=r"shape \(4,\) and dtype float32; device 1 asked for shape \(5,\)"):
        model.init_key((5,), 1, 1)


def test_second_pull_req_before_pull_wait_is_refused(make_model):
    model = make_model([0, 1])
    for devid in (0, 1):
        model.init_key((1,), 3, devid)
    data = np.zeros(1, np.float32)
    model.push(data, 3, 0)
    model.pull_req(data, 3, 0)
    with pytest.raises(DuplicatePullError, match=r"key 3 on device 0 .* call pull_wait\(3, 0\) first"):
        model.pull_req(data, 3, 0)
    model.push(data, 3, 1)
    model.pull_wait(3, 0)


def test_parameters_are_checked_and_fixed_at_init(make_model):
    model = create_shared_model("local", device="cpu")
    with pytest.raises(ConfigError, match=r"unknown shared-model parameter 'push_threads'; known parameters: update_on_server"):
        model.set_param("push_threads", "one")
    with pytest.raises(ConfigError, match=r"'pull_thread' must be one of ndev, one; got 'two'"):
        model.set_param("pull_thread", "two")
    with pytest.raises(ConfigError, match=r"'push_op\[3\]' must be one of sum, gather"):
        model.set_param("push_op[3]", "max")
    with pytest.raises(StateError, match=r"push before init"):
        model.push(np.zeros(1, np.float32), 0, 0)
    model.init([0])
    try:
        with pytest.raises(StateError, match=r"set_param\('timeout', 5\) after init"):
            model.set_param("timeout", 5)
        with pytest.raises(StateError, match=r"init\(\) was already called"):
            model.init([0])
    finally:
        model.close()
    with pytest.raises(StateError, match=r"push on a closed shared model"):
        model.push(np.zeros(1, np.float32), 0, 0)


def test_unknown_model_kind_lists_the_known_kinds():
    with pytest.raises(ConfigError, match=r"unknown shared model kind 'remote'; known kinds: local, dist"):
        create_shared_model("remote")


def test_dist_without_an_updater_fails_clearly():
    model = create_shared_model("dist")
    with pytest.raises(ConfigError, match=r"a 'dist' model needs a ModelUpdater"):
        model.init([0])
    assert _model_threads() == []


def test_update_on_server_without_an_updater_fails_clearly():
    model = create_shared_model("local", update_on_server=1)
    with pytest.raises(ConfigError, match=r"update_on_server=1 needs a ModelUpdater"):
        model.init([0])


def test_updater_that_does_not_implement_update_fails_the_pull_naming_the_key(make_model):
    model = make_model([0], update_on_server=1, updater=ModelUpdater())
    model.init_key((1,), "w", 0)
    data = np.zeros(1, np.float32)
    model.push(data, "w", 0)
    model.pull_req(data, "w", 0)
    with pytest.raises(PullFailedError, match=r"key 'w': copying device 0's push of round 1 failed: NotImplementedError"):
        model.pull_wait("w", 0)
    with pytest.raises(PullFailedError, match=r"the key failed earlier"):
        model.push(data, "w", 0)


def test_close_fails_an_outstanding_pull_and_stops_the_threads(make_model):
    model = make_model([0, 1])
    model.init_key((1,), 0, 0)
    data = np.zeros(1, np.float32)
    model.push(data, 0, 0)
    model.pull_req(data, 0, 0)
    model.close()
    assert _model_threads() == []
    with pytest.raises(StateError):
        model.pull_wait(0, 0)


@pytest.mark.parametrize("threads", ["ndev", "one"])
def test_a_device_pushing_rounds_ahead_waits_for_buffers_and_gets_the_latest_round(make_model, threads):
    model = make_model([0, 1], push_thread=threads)
    for devid in (0, 1):
        model.init_key((2,), "g", devid)
    ahead = [np.full(2, 10 * r, np.float32) for r in (1, 2, 3)]
    for value in ahead:  # three rounds from device 0 before device 1 pushed anything
        model.push(value, "g", 0)
    behind = [np.full(2, r, np.float32) for r in (1, 2, 3)]
    for value in behind:
        model.push(value, "g", 1)
    out0, out1 = np.zeros(2, np.float32), np.zeros(2, np.float32)
    model.pull_req(out0, "g", 0)
    model.pull_req(out1, "g", 1)
    model.pull_wait("g", 0)
    model.pull_wait("g", 1)
    np.testing.assert_array_equal(out0, [33, 33])
    np.testing.assert_array_equal(out1, [33, 33])


@pytest.mark.parametrize("threads", ["ndev", "one"])
def test_random_priorities_and_wait_orders_keep_every_round_exact(make_model, threads):
    devids = [0, 1, 2, 3]
    keys = [f"k{i}" for i in range(6)]
    model = make_model(devids, push_thread=threads, pull_thread=threads)
    rounds = 15
    wrong = []

    def device(devid):
        rng = np.random.default_rng(devid)
        for key in keys:
            model.init_key((3, 7), key, devid, dtype=np.int64)
        bufs = {key: np.empty((3, 7), np.int64) for key in keys}
        for r in range(rounds):
            for i, key in enumerate(rng.permutation(keys)):
                bufs[key][...] = 1000 * r + 10 * devid + int(key[1:])
                model.push(bufs[key], key, devid, priority=int(rng.integers(-3, 4)))
                model.pull_req(bufs[key], key, devid, priority=int(rng.integers(-3, 4)))
            for key in rng.permutation(keys):
                model.pull_wait(key, devid)
                expected = 4 * 1000 * r + 10 * sum(devids) + 4 * int(key[1:])
                if not np.all(bufs[key] == expected):
                    wrong.append((devid, r, key, int(bufs[key][0, 0]), expected))

    run_device_threads(device, devids)
    assert wrong == []


def test_lockstep_device_gets_exact_rounds_while_another_pushes_ahead(make_model):
    model = make_model([0, 1])
    for devid in (0, 1):
        model.init_key((4,), "g", devid, dtype=np.int64)
    rounds = 12
    ahead = [np.full(4, 100 * (r + 1), np.int64) for r in range(rounds)]
    seen = []

    def lockstep():
        mine = np.zeros(4, np.int64)
        for r in range(rounds):
            mine[...] = r + 1
            model.push(mine, "g", 0)
            model.pull_req(mine, "g", 0)
            model.pull_wait("g", 0)
            seen.append(mine.copy())

    t = threading.Thread(target=lockstep)
    t.start()
    for value in ahead:  # all rounds at once, never waiting
        model.push(value, "g", 1)
    t.join(30)
    assert not t.is_alive()
    for r, got in enumerate(seen):
        np.testing.assert_array_equal(got, np.full(4, 101 * (r + 1)), err_msg=f"round {r + 1}")
    last = np.zeros(4, np.int64)
    model.pull_req(last, "g", 1)
    model.pull_wait("g", 1)
    np.testing.assert_array_equal(last, np.full(4, 101 * rounds))
