"""The local and device KVStores keep MXNet's KVStore semantics."""

import numpy as np
import pytest

import kvcore
from kvcore.errors import (
    DTypeMismatchError,
    DuplicateKeyError,
    KeyTypeError,
    KVStoreError,
    OptimizerError,
    OutShapeError,
    ReadOnlyOutError,
    ShapeMismatchError,
    UninitializedKeyError,
    UnknownStoreError,
    ValueCountError,
)

pytestmark = pytest.mark.unit

SHAPE = (2, 3)


def ones(scale=1.0, shape=SHAPE, dtype=np.float32):
    return np.ones(shape, dtype) * scale


def pulled(kv, key, shape=SHAPE, dtype=np.float32):
    out = np.full(shape, -1, dtype)
    kv.pull(key, out=out)
    return out


@pytest.fixture(params=["local", "device"])
def kv(request):
    return kvcore.create(request.param)


def test_create_reports_type_rank_and_one_worker(kv):
    assert kv.type in ("local", "device")
    assert kv.rank == 0
    assert kv.num_workers == 1
    kv.barrier()  # a no-op locally, must simply return


def test_create_unknown_name_lists_known_stores():
    with pytest.raises(UnknownStoreError) as info:
        kvcore.create("dist_bogus")
    message = str(info.value)
    assert "'dist_bogus'" in message and "local" in message and "device" in message
    assert isinstance(info.value, KVStoreError)


def test_init_then_pull_returns_initial_value(kv):
    kv.init(3, ones(2))
    assert np.array_equal(pulled(kv, 3), ones(2))


def test_push_replaces_stored_value_with_default_updater(kv):
    kv.init(3, ones(2))
    kv.push(3, ones(8))
    assert np.array_equal(pulled(kv, 3), ones(8))


def test_push_of_device_list_sums_values(kv):
    kv.init(3, ones(2))
    kv.push(3, [ones(), ones()])
    assert np.array_equal(pulled(kv, 3), ones(2))


def test_updater_receives_merged_value_and_mutates_stored(kv):
    kv.init(3, ones(2))

    def updater(key, merged, stored):
        stored += merged * 2

    kv.set_updater(updater)
    kv.push(3, [ones(), ones()])
    assert np.array_equal(pulled(kv, 3), ones(6))


def test_private_set_updater_alias_works(kv):
    kv.init(3, ones(2))
    kv._set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    kv.push(3, ones())
    assert np.array_equal(pulled(kv, 3), ones(3))


def test_list_of_keys_with_updater_each_pull_four(kv):
    keys = [5, 7, 9]
    kv.init(keys, [ones()] * 3)

    def updater(key, merged, stored):
        stored += merged * 3

    kv.set_updater(updater)
    kv.push(keys, [ones()] * 3)
    outs = [np.zeros(SHAPE, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    for out in outs:
        assert np.array_equal(out, ones(4))


def test_list_of_keys_takes_list_of_device_lists(kv):
    kv.init([1, 2], [ones(), ones()])
    kv.push([1, 2], [[ones(1), ones(2)], [ones(3), ones(4), ones(5)]])
    assert np.array_equal(pulled(kv, 1), ones(3))
    assert np.array_equal(pulled(kv, 2), ones(12))


def test_pull_into_list_gives_every_device_the_value(kv):
    kv.init("w", ones(7))
    outs = [np.zeros(SHAPE, np.float32) for _ in range(3)]
    kv.pull("w", out=outs)
    for out in outs:
        assert np.array_equal(out, ones(7))


def test_pull_writes_into_out_in_place(kv):
    kv.init(1, ones(5))
    out = np.zeros(SHAPE, np.float32)
    alias = out
    kv.pull(1, out=out)
    assert alias is out and np.array_equal(alias, ones(5))


def test_pushpull_defaults_out_to_value(kv):
    kv.init(1, ones(0))
    kv.set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    value = ones(4)
    kv.pushpull(1, value)
    assert np.array_equal(value, ones(4))
    out = np.zeros(SHAPE, np.float32)
    kv.pushpull(1, ones(1), out=out)
    assert np.array_equal(out, ones(5))


def test_str_keys_work(kv):
    kv.init(["a", "b"], [ones(1), ones(2)])
    kv.push("b", ones(9))
    assert np.array_equal(pulled(kv, "a"), ones(1))
    assert np.array_equal(pulled(kv, "b"), ones(9))


def test_numpy_integer_keys_are_the_same_as_int_keys(kv):
    kv.init(np.int64(4), ones(3))
    assert np.array_equal(pulled(kv, 4), ones(3))


def test_handles_returned_by_local_store_are_done(kv):
    kv.init(1, ones())
    assert kv.push(1, ones(2)).done()
    out = np.zeros(SHAPE, np.float32)
    handle = kv.pull(1, out=out, wait=False)
    handle.wait(timeout=1)
    assert np.array_equal(out, ones(2))


def test_pushed_array_can_be_modified_after_push(kv):
    kv.init(1, ones())
    value = ones(2)
    kv.push(1, value)
    value[...] = 100
    assert np.array_equal(pulled(kv, 1), ones(2))


def test_push_without_a_copy_is_taken_and_the_value_is_the_same(kv):
    kv.init(1, ones())
    value = ones(3)
    kv.push(1, value, copy=False).wait()  # the local store keeps no reference to it either
    value[...] = 100
    assert np.array_equal(pulled(kv, 1), ones(3))


# ---- errors ---------------------------------------------------------------------------------


def test_push_of_uninitialised_key_raises_naming_key(kv):
    with pytest.raises(UninitializedKeyError, match=r"push of key 11.*never initialised"):
        kv.push(11, ones())


def test_pull_of_uninitialised_key_raises_naming_key(kv):
    kv.init("w", ones())
    with pytest.raises(UninitializedKeyError, match=r"pull of key 'x'.*initialised keys: 'w'") as info:
        kv.pull("x", out=ones())
    assert isinstance(info.value, KeyError)


def test_init_twice_raises_duplicate_key(kv):
    kv.init(1, ones())
    with pytest.raises(DuplicateKeyError, match="key 1 is already initialised"):
        kv.init(1, ones())


def test_init_same_key_twice_in_one_list_raises(kv):
    with pytest.raises(DuplicateKeyError, match="key 2"):
        kv.init([2, 2], [ones(), ones()])
    # nothing was initialised by the failed call
    with pytest.raises(UninitializedKeyError):
        kv.push(2, ones())


def test_push_shape_mismatch_names_both_shapes(kv):
    kv.init(1, ones())
    with pytest.raises(ShapeMismatchError) as info:
        kv.push(1, np.ones((3, 2), np.float32))
    assert "(2, 3)" in str(info.value) and "(3, 2)" in str(info.value) and "key 1" in str(info.value)


def test_push_dtype_mismatch_names_both_dtypes(kv):
    kv.init(1, ones())
    with pytest.raises(DTypeMismatchError) as info:
        kv.push(1, np.ones(SHAPE, np.float64))
    assert "float32" in str(info.value) and "float64" in str(info.value)


def test_failed_push_leaves_stored_value_untouched(kv):
    kv.init(1, ones(2))
    with pytest.raises(ShapeMismatchError):
        kv.push(1, [ones(5), np.ones((1, 1), np.float32)])
    assert np.array_equal(pulled(kv, 1), ones(2))


def test_pull_into_out_of_wrong_shape_raises_out_shape_error(kv):
    kv.init(1, ones())
    with pytest.raises(OutShapeError) as info:
        kv.pull(1, out=np.zeros((6,), np.float32))
    assert "(2, 3)" in str(info.value) and "(6,)" in str(info.value)
    assert isinstance(info.value, ShapeMismatchError)


def test_pull_into_a_read_only_out_raises_naming_the_key_and_writes_nothing(kv):
    kv.init(1, ones())
    out = np.zeros((2, 3), np.float32)
    out.flags.writeable = False
    with pytest.raises(ReadOnlyOutError) as info:
        kv.pull(1, out=out)
    assert "key 1" in str(info.value) and "read-only" in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(ReadOnlyOutError):  # one of a list's outs
        kv.pull([1, 1], out=[np.zeros((2, 3), np.float32), out])
    assert not out.any()


def test_pull_into_out_of_wrong_dtype_raises(kv):
    kv.init(1, ones())
    with pytest.raises(DTypeMismatchError, match="int32"):
        kv.pull(1, out=np.zeros(SHAPE, np.int32))


def test_mixing_int_and_str_keys_raises(kv):
    kv.init(1, ones())
    with pytest.raises(KeyTypeError, match=r"int keys.*'a'"):
        kv.init("a", ones())


def test_key_of_another_type_raises(kv):
    with pytest.raises(KeyTypeError, match="1.5"):
        kv.init(1.5, ones())


def test_list_of_keys_with_wrong_number_of_values_raises(kv):
    with pytest.raises(ValueCountError, match="2 keys"):
        kv.init([1, 2], [ones()])


def test_non_array_value_raises_type_error_naming_type(kv):
    with pytest.raises(TypeError, match="list|int"):
        kv.init(1, [[1, 2, 3]])


def test_pull_without_out_raises(kv):
    kv.init(1, ones())
    with pytest.raises(ValueCountError, match="needs out="):
        kv.pull(1)


# ---- row_sparse_pull ------------------------------------------------------------------------


def test_row_sparse_pull_fills_requested_rows_and_zeros_elsewhere(kv):
    value = np.arange(12, dtype=np.float32).reshape(4, 3)
    kv.init("emb", value)
    out = np.full((4, 3), -1, np.float32)
    kv.row_sparse_pull("emb", out=out, row_ids=np.array([2, 0, 2]))
    expected = np.zeros((4, 3), np.float32)
    expected[[0, 2]] = value[[0, 2]]
    assert np.array_equal(out, expected)


def test_row_sparse_pull_with_empty_row_ids_gives_zeros(kv):
    kv.init("emb", np.ones((4, 3), np.float32))
    out = np.full((4, 3), 7, np.float32)
    kv.row_sparse_pull("emb", out=out, row_ids=[])
    assert not out.any()


def test_row_sparse_pull_into_list_with_row_ids_per_out(kv):
    value = np.arange(8, dtype=np.float32).reshape(4, 2)
    kv.init(1, value)
    outs = [np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)]
    kv.row_sparse_pull(1, out=outs, row_ids=[np.array([1]), np.array([3])])
    assert np.array_equal(outs[0][1], value[1]) and not outs[0][[0, 2, 3]].any()
    assert np.array_equal(outs[1][3], value[3]) and not outs[1][[0, 1, 2]].any()


def test_row_sparse_pull_into_row_sparse_array_keeps_indices_and_rows(kv):
    value = np.arange(8, dtype=np.float32).reshape(4, 2)
    kv.init(1, value)
    out = kvcore.RowSparseArray(shape=(4, 2), dtype=np.float32)
    kv.row_sparse_pull(1, out=out, row_ids=np.array([3, 1]))
    assert out.indices.tolist() == [1, 3]
    assert np.array_equal(out.data, value[[1, 3]])
    assert np.array_equal(out.todense()[[1, 3]], value[[1, 3]])


def test_row_sparse_pull_out_of_range_row_raises_naming_row(kv):
    kv.init(1, np.zeros((4, 2), np.float32))
    with pytest.raises(IndexError, match="4 rows.*9"):
        kv.row_sparse_pull(1, out=np.zeros((4, 2), np.float32), row_ids=np.array([9]))


# ---- optimizers inside the store --------------------------------------------------------


def test_set_optimizer_runs_sgd_inside_the_store(kv):
    kv.set_optimizer(kvcore.optim.SGD(learning_rate=0.5))
    kv.init(0, ones(1))
    kv.push(0, [ones(1), ones(1)])
    assert np.allclose(pulled(kv, 0), ones(1 - 0.5 * 2))


def test_test_optimizer_adds_rescaled_gradient(kv):
    kv.set_optimizer(kvcore.optim.create("test", rescale_grad=2.0))
    kv.init(0, ones(1))
    for step in range(3):
        kv.push(0, ones(step + 1))
    assert np.array_equal(pulled(kv, 0), ones(1 + 2 * (1 + 2 + 3)))


def test_optimizer_states_round_trip_through_a_file(kv, tmp_path):
    kv.set_optimizer(kvcore.optim.SGD(learning_rate=0.1, momentum=0.9))
    kv.init(0, ones(0))
    kv.push(0, ones(1))
    path = tmp_path / "states.bin"
    kv.save_optimizer_states(str(path))
    kv.push(0, ones(1))
    after_two = pulled(kv, 0)

    other = kvcore.create(kv.type)
    other.set_optimizer(kvcore.optim.SGD(learning_rate=0.1, momentum=0.9))
    other.init(0, ones(-0.1))  # the weight after the first step
    other.load_optimizer_states(str(path))
    other.push(0, ones(1))
    assert np.allclose(pulled(other, 0), after_two)


def test_saving_states_without_optimizer_raises(kv, tmp_path):
    with pytest.raises(OptimizerError, match="no optimizer"):
        kv.save_optimizer_states(str(tmp_path / "x"))


def test_non_callable_updater_raises(kv):
    with pytest.raises(OptimizerError, match="callable"):
        kv.set_updater(42)
