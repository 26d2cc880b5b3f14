"""The shared model's argument checks refuse what cannot work, naming the values (kvcore.shared_model.checks)."""

import numpy as np
import pytest

from kvcore import arrays
from kvcore.shared_model.checks import as_shape, check_array, check_ids, check_updater_config, resolve_device_kind
from kvcore.shared_model.config import SharedModelConfig
from kvcore.shared_model.errors import ConfigError, KeyShapeError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("ids,message", [
    ([], "needs at least one device id, got an empty list"),
    ([0, -1], "device ids are ints >= 0, got -1 in [0, -1]"),
    ([0, True], "got True in [0, True]"),
    ([0, "1"], "got '1' in [0, '1']"),
    ([1, 1], "device ids must be distinct, got [1, 1]"),
])
def test_device_ids_are_distinct_ints_from_0(ids, message):
    with pytest.raises(ConfigError) as caught:
        check_ids(ids)
    assert message in str(caught.value)


def test_one_int_is_one_device_and_numpy_ints_count_as_ints():
    assert check_ids(3) == [3]
    assert check_ids([np.int64(0), 2]) == [0, 2]


class Updater:
    pass


@pytest.mark.parametrize("kind,on_server,updater,ops,message", [
    ("dist", 0, Updater(), {}, "update_on_server=0 is not supported"),
    ("dist", 1, None, {}, "a 'dist' model needs a ModelUpdater"),
    ("dist", 1, Updater(), {3: "gather", 4: "sum"}, "push_op 'gather' is only supported by a 'local' model; keys [3]"),
    ("local", 1, None, {}, "update_on_server=1 needs a ModelUpdater"),
    ("local", 0, Updater(), {}, "a ModelUpdater was given but update_on_server=0"),
])
def test_combinations_that_cannot_work_are_refused_saying_what_to_change(kind, on_server, updater, ops, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_updater_config(kind, on_server, updater, SharedModelConfig(push_ops=ops))


def test_combinations_that_work_pass():
    check_updater_config("dist", 1, Updater(), SharedModelConfig(push_ops={3: "sum"}))
    check_updater_config("local", 1, Updater(), SharedModelConfig(push_ops={3: "gather"}))
    check_updater_config("local", 0, None, SharedModelConfig())


def test_cpu_slots_unless_gpus_are_asked_for_and_asking_without_one_is_an_error():
    assert resolve_device_kind("cpu", [0, 1]) is False
    if arrays.gpu_available():
        pytest.skip("this machine has a GPU: asking for one is no error here")
    assert resolve_device_kind("auto", [0]) is False
    with pytest.raises(ConfigError, match=r"set_param\('device', 'gpu'\) was given, but no usable GPU was found"):
        resolve_device_kind("gpu", [0])


def test_a_shape_is_an_int_or_a_sequence_of_non_negative_ints():
    assert as_shape(4, "k") == (4,)
    assert as_shape([2, np.int32(3)], "k") == (2, 3)
    with pytest.raises(KeyShapeError, match=r"init_key of key 'k': shape must be a tuple of ints, got None"):
        as_shape(None, "k")
    with pytest.raises(KeyShapeError, match=r"init_key of key 7: shape \(2, -1\) has a negative dimension"):
        as_shape((2, -1), 7)


def test_an_array_of_another_kind_shape_or_dtype_is_refused_naming_key_device_and_both_values():
    shape, dtype = (2, 3), np.dtype(np.float32)
    check_array(np.zeros(shape, np.float32), shape, dtype, "w", 1, "push")
    with pytest.raises(KeyShapeError, match=r"push of key 'w' on device 1: expected a numpy or CuPy array, got list"):
        check_array([[0.0] * 3] * 2, shape, dtype, "w", 1, "push")
    with pytest.raises(KeyShapeError, match=r"the key has shape \(2, 3\), the array has shape \(3, 2\)"):
        check_array(np.zeros((3, 2), np.float32), shape, dtype, "w", 1, "pull_req")
    with pytest.raises(KeyShapeError, match=r"the key has dtype float32, the array has dtype float64"):
        check_array(np.zeros(shape, np.float64), shape, dtype, "w", 1, "push")
