"""split_and_load and SplitSampler: how a batch is split across devices and a dataset across workers."""

import types

import numpy as np
import pytest
from kvcore_testkit import gpu_test

import kvcore
from kvcore import SplitSampler, arrays, split_and_load
from kvcore.dataparallel import split_data

pytestmark = pytest.mark.unit


def test_split_and_load_splits_evenly_into_views_on_the_cpu():
    data = np.arange(24, dtype=np.float32).reshape(6, 4)
    parts = split_and_load(data, [kvcore.cpu(), kvcore.cpu()])
    assert [p.shape for p in parts] == [(3, 4), (3, 4)]
    np.testing.assert_array_equal(np.concatenate(parts), data)
    assert all(np.shares_memory(p, data) for p in parts)


def test_split_and_load_with_one_device_returns_the_whole_batch_unsplit():
    data = np.arange(10, dtype=np.float32)
    parts = split_and_load(data, kvcore.cpu())
    assert len(parts) == 1 and parts[0] is data
    assert split_and_load(data, ["cpu"])[0] is data


def test_split_and_load_along_another_batch_axis():
    data = np.arange(24).reshape(2, 12)
    parts = split_and_load(data, ["cpu", "cpu", "cpu"], batch_axis=1)
    assert [p.shape for p in parts] == [(2, 4)] * 3
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), data)


def test_split_and_load_raises_naming_batch_size_and_device_count_when_uneven():
    data = np.zeros((10, 2))
    with pytest.raises(ValueError) as info:
        split_and_load(data, [kvcore.cpu()] * 3)
    message = str(info.value)
    assert "10" in message and "3 devices" in message


def test_split_and_load_uneven_split_gives_the_first_slices_one_more():
    data = np.arange(10)
    parts = split_and_load(data, [kvcore.cpu()] * 3, even_split=False)
    assert [len(p) for p in parts] == [4, 3, 3]
    np.testing.assert_array_equal(np.concatenate(parts), data)


def test_split_and_load_rejects_a_batch_smaller_than_the_device_count():
    with pytest.raises(ValueError, match="size 2 cannot give each of 3 devices"):
        split_and_load(np.zeros(2), [kvcore.cpu()] * 3, even_split=False)


def test_split_and_load_rejects_a_bad_batch_axis_naming_the_shape():
    with pytest.raises(ValueError, match=r"batch_axis 2 .* shape \(4, 3\)"):
        split_and_load(np.zeros((4, 3)), kvcore.cpu(), batch_axis=2)


def test_split_and_load_rejects_no_devices_and_non_devices():
    with pytest.raises(ValueError, match="at least one device"):
        split_and_load(np.zeros(4), [])
    with pytest.raises(TypeError, match="Device"):
        split_and_load(np.zeros(4), [3])
    with pytest.raises(TypeError, match="numpy or CuPy array"):
        split_data([1, 2, 3, 4], 2)


@gpu_test
def test_split_and_load_places_slices_on_the_gpus():
    data = np.arange(8, dtype=np.float32)
    devices = [kvcore.gpu(i % arrays.num_gpus()) for i in range(2)]
    parts = split_and_load(data, devices)
    assert [arrays.device_of(p) for p in parts] == devices
    np.testing.assert_array_equal(np.concatenate([arrays.asnumpy(p) for p in parts]), data)


@gpu_test
def test_split_and_load_of_a_gpu_batch_gives_views_on_its_gpu_and_copies_elsewhere():
    cp = arrays.cupy_module()
    with arrays.device_context(kvcore.gpu(0)):
        data = cp.arange(24, dtype=cp.float32).reshape(8, 3)
    views = split_and_load(data, [kvcore.gpu(0), "gpu:0"])
    assert [v.data.ptr for v in views] == [data.data.ptr, data[4:].data.ptr]  # no copies
    on_host = split_and_load(data, [kvcore.cpu(), kvcore.cpu()], batch_axis=1, even_split=False)
    assert [type(p) for p in on_host] == [np.ndarray, np.ndarray]
    np.testing.assert_array_equal(np.concatenate(on_host, axis=1), cp.asnumpy(data))
    if arrays.num_gpus() > 1:
        parts = split_and_load(data, [kvcore.gpu(1), kvcore.gpu(0)])
        assert [arrays.device_of(p) for p in parts] == [kvcore.gpu(1), kvcore.gpu(0)]
        np.testing.assert_array_equal(np.concatenate([cp.asnumpy(p) for p in parts]), cp.asnumpy(data))


def _parts(length, num_parts, epoch=0, **kwargs):
    return [SplitSampler(length, num_parts, k, **kwargs).indices(epoch) for k in range(num_parts)]


@pytest.mark.parametrize("length,num_parts", [(10, 3), (12, 4), (7, 1), (5, 5), (3, 4)])
def test_split_sampler_parts_are_disjoint_and_cover_the_dataset(length, num_parts):
    parts = _parts(length, num_parts, seed=7)
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(length))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == [len(SplitSampler(length, num_parts, k)) for k in range(num_parts)]


def test_split_sampler_drop_last_gives_every_part_the_same_length():
    parts = _parts(10, 3, seed=1, drop_last=True)
    assert [len(p) for p in parts] == [3, 3, 3]
    assert len(set(np.concatenate(parts).tolist())) == 9
    assert len(SplitSampler(10, 3, 2, drop_last=True)) == 3


def test_split_sampler_reshuffles_every_epoch_and_repeats_an_epoch_exactly():
    sampler = SplitSampler(100, 2, 1, seed=3)
    first = list(sampler)
    second = list(sampler)
    assert first != second
    assert sampler.epoch == 2
    sampler.set_epoch(0)
    assert list(sampler) == first
    assert list(SplitSampler(100, 2, 1, seed=3)) == first
    assert list(SplitSampler(100, 2, 1, seed=4)) != first


def test_split_sampler_every_epoch_stays_disjoint_and_covering_across_parts():
    samplers = [SplitSampler(50, 3, k, seed=9) for k in range(3)]
    for _ in range(4):
        joined = [i for s in samplers for i in s]
        assert sorted(joined) == list(range(50))


def test_split_sampler_parts_batches_together_equal_one_parts_batch():
    # n workers taking B/n per step see the same global batches as one worker taking B.
    length, batch = 103, 8
    whole = SplitSampler(length, 1, 0, seed=5, drop_last=True).indices(2)
    halves = [SplitSampler(length, 2, k, seed=5, drop_last=True).indices(2) for k in range(2)]
    for t in range(len(halves[0]) // (batch // 2)):
        joined = np.concatenate([h[t * batch // 2:(t + 1) * batch // 2] for h in halves])
        assert sorted(joined.tolist()) == sorted(whole[t * batch:(t + 1) * batch].tolist())


def test_split_sampler_seed_none_means_the_same_permutation_in_every_part():
    assert SplitSampler(20, 2, 0).indices().tolist() == SplitSampler(20, 2, 0, seed=0).indices().tolist()


@pytest.mark.parametrize(
    "args,pattern",
    [
        ((10, 3, 3), r"part_index 3 is out of range for 3 parts \(expected 0\.\.2\)"),
        ((10, 3, -1), r"part_index -1 is out of range for 3 parts"),
        ((10, 0, 0), r"num_parts must be >= 1, got 0"),
        ((-1, 2, 0), r"length must be >= 0, got -1"),
    ],
)
def test_split_sampler_rejects_bad_arguments_naming_them(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        SplitSampler(*args)


def test_split_sampler_rejects_a_negative_epoch():
    with pytest.raises(ValueError, match="epoch must be >= 0, got -2"):
        SplitSampler(10).set_epoch(-2)


def test_elastic_batches_walk_each_epochs_permutation_and_share_the_last_step_without_dropping():
    kv = kvcore.create("local")  # one member, index 0
    state = types.SimpleNamespace(epoch=0, seen=0)
    sampler = SplitSampler(10, seed=3)
    batches = sampler.elastic_batches(kv, state, 4)
    first = [next(batches) for _ in range(3)]
    assert [len(b) for b in first] == [4, 4, 2] and sorted(np.concatenate(first).tolist()) == list(range(10))
    assert np.concatenate(first).tolist() == sampler.indices(0).tolist()  # the epoch's permutation, in order
    assert (state.epoch, state.seen) == (0, 8)  # the place is taken once the next batch is asked for
    assert next(batches).tolist() == sampler.indices(1)[:4].tolist() and (state.epoch, state.seen) == (1, 0)
    dropping = SplitSampler(10, seed=3, drop_last=True).elastic_batches(kv, types.SimpleNamespace(epoch=0, seen=0), 4)
    assert [len(next(dropping)) for _ in range(3)] == [4, 4, 4]  # the third is epoch 1's first


def test_elastic_batches_need_the_state_scalars_and_a_batch():
    kv = kvcore.create("local")
    with pytest.raises(ValueError, match="state.epoch and state.seen"):
        next(SplitSampler(10).elastic_batches(kv, types.SimpleNamespace(epoch=0), 4))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(SplitSampler(10).elastic_batches(kv, types.SimpleNamespace(epoch=0, seen=0), 0))
