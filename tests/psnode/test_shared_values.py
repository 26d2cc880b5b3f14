"""A server's value regions (psnode.server.shared_values) and the store over them: a region is handed
out again only once nothing of the server's refers to it and every worker that read it wrote its
receipt, the pool is bounded, and the store never writes a value a worker may still be reading."""

import gc

import numpy as np
import pytest

from psnode.server.shard_memory import HostMemory
from psnode.server.shared_values import SPARE, Receipt, SharedValues, give_up
from psnode.server.store import ServerStore
from psnode.transport import same_host

pytestmark = pytest.mark.unit

TAG = same_host.job_tag("job-shared-values")


def address(array: np.ndarray) -> int:
    return array.ctypes.data


def test_a_region_comes_back_only_once_its_array_is_dropped_and_every_receipt_given_for_it_is_written():
    shared = SharedValues(TAG, min_bytes=64)
    first = shared.empty(4096, np.float32, placed=True)
    where = address(first)
    cell = np.zeros(1, np.uint64)  # the worker's receipt cell (in its pull region, in a job)
    ref = shared.serve(first, Receipt(cell, 1))
    assert ref == shared.region_of(first).region.ref and same_host.decode(ref)[1] > 0
    del first
    gc.collect()
    second = shared.empty(4096, np.float32)
    assert address(second) != where  # the worker has not written its receipt: it may still be reading
    cell[0] = 1
    del second
    gc.collect()
    assert address(shared.empty(4096, np.float32)) == where


def test_a_view_or_part_of_a_value_is_not_served_and_small_values_stay_private():
    shared = SharedValues(TAG, min_bytes=64)
    value = shared.empty(4096, np.float32, placed=True)
    assert shared.region_of(value) is not None
    assert shared.region_of(value[1:]) is None and shared.region_of(value[:10]) is None
    assert shared.serve(value[::2], Receipt(np.zeros(1, np.uint64), 1)) is None
    assert shared.empty(32, np.float32, placed=True) is None


def test_the_pool_holds_at_most_spare_times_the_values_placed_then_host_memory_is_private():
    shared = SharedValues(TAG, min_bytes=64)
    memory = HostMemory(shared)
    kept = [memory.place(np.ones(1024, np.float32))]  # 4 KiB placed: at most SPARE regions of it
    kept += [memory.empty_like(kept[0]) for _ in range(SPARE - 1)]
    assert all(shared.region_of(a) is not None for a in kept)
    assert shared.held == SPARE * 4096
    private = memory.empty_like(kept[0])
    assert shared.region_of(private) is None and private.shape == (1024,)
    copied = memory.copy(kept[0])
    assert shared.region_of(copied) is None and copied.tolist() == [1.0] * 1024


def test_the_pool_leaves_most_descriptors_to_sockets():
    shared = SharedValues(TAG, min_bytes=64)
    shared.max_regions = 2  # a quarter of a process's descriptors, in a job
    kept = [shared.empty(4096, np.float32, placed=True) for _ in range(3)]
    assert [shared.region_of(a) is not None for a in kept if a is not None] == [True, True] and kept[2] is None


def test_a_worker_that_is_gone_has_read_everything_it_was_given():
    cell = np.zeros(1, np.uint64)
    receipts = [Receipt(cell, n) for n in (1, 2, 5)]
    cell[0] = 2
    assert [r.done for r in receipts] == [True, True, False]
    give_up(cell)
    assert all(r.done for r in receipts)


class Replies:
    """Answered pulls, as the server's replies would get them: a worker reading a value in the
    server's memory is a receipt among the shard's trackers until the worker writes it."""

    def __init__(self, shared: SharedValues):
        self.shared = shared
        self.cells: list[np.ndarray] = []

    def answer(self, worker, req_id, index, shard):
        cell = np.zeros(1, np.uint64)
        receipt = Receipt(cell, 1)
        assert self.shared.serve(shard.stored, receipt) is not None
        shard.trackers.append(receipt)
        self.cells.append((cell, shard.stored, shard.stored.copy()))


@pytest.mark.parametrize("optimizer", [False, True], ids=["sum", "optimizer"])
def test_the_store_never_writes_a_value_a_worker_is_still_copying_and_reuses_it_once_read(optimizer):
    shared = SharedValues(TAG, min_bytes=64)
    store, replies = ServerStore(2, HostMemory(shared)), Replies(shared)
    if optimizer:
        store.set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    store.init(3, "w", np.zeros(1024, np.float32), sync=True, row_size=1)
    shard = store.shard(3)

    def round_(value: float) -> None:
        for worker in (0, 1):
            store.push(shard, worker, np.full(1024, value, np.float32), replies.answer)

    round_(1.0)
    store.pull(shard, 0, 7, 0, 1, replies.answer)  # worker 0 starts copying the value out
    (cell, read, seen), = replies.cells
    for value in (2.0, 3.0, 4.0):  # rounds go on while it copies: its value stays as it was
        round_(value)
    assert np.array_equal(read, seen) and read.tolist() == [2.0] * 1024
    assert shard.stored.tolist() == ([20.0] if optimizer else [8.0]) * 1024
    grown = shared.held
    cell[0] = 1  # worker 0 is done: from now on the rounds take turns in the regions there are
    del read, replies.cells[:]
    for value in range(5, 12):
        round_(float(value))
    gc.collect()
    assert shared.held == grown <= SPARE * 4096
