"""A server's store alone: shards, updaters, refusals, and the key-group fast path with its way back."""

import numpy as np
import pytest

from psnode.errors import RequestRefused
from psnode.node.protocol import ENTRY
from psnode.server.groups import MIN_GROUP, Groups
from psnode.server.store import ServerStore

pytestmark = pytest.mark.unit


class Replies:
    """What a server would send, kept for the test: answered pulls and whole group replies."""

    def __init__(self):
        self.answers = []
        self.sent = []

    def answer(self, worker, req_id, index, shard):
        self.answers.append((worker, req_id, index, shard.error or shard.stored.tolist()))

    def send_to(self, worker, frames, pull_req=None):
        self.sent.append((worker, frames))


def test_pushes_of_every_worker_close_a_round_and_release_the_pulls_waiting_for_it():
    store, replies = ServerStore(num_workers=2), Replies()
    store.init(5, "w", np.zeros(3, np.float32), sync=True, row_size=1)
    shard = store.shard(5)
    store.push(shard, 0, np.ones(3, np.float32), replies.answer)
    store.pull(shard, 0, 11, 0, 1, replies.answer)  # must include worker 0's push: waits
    assert replies.answers == []
    store.push(shard, 1, np.full(3, 2, np.float32), replies.answer)
    assert replies.answers == [(0, 11, 0, [3.0, 3.0, 3.0])]


def test_an_updater_runs_once_per_round_with_the_sum_and_the_stored_value():
    store, replies, calls = ServerStore(num_workers=2), Replies(), []

    def sgd(key, merged, stored):
        calls.append((key, merged.tolist()))
        stored -= 0.5 * merged

    store.set_updater(sgd)
    store.init(1, "w", np.ones((2, 2), np.float32), sync=True, row_size=2)
    shard = store.shard(1)
    for worker in (0, 1):
        store.push(shard, worker, np.ones(4, np.float32), replies.answer)
    assert calls == [("w", [[2.0, 2.0], [2.0, 2.0]])]
    assert shard.stored.tolist() == [0.0] * 4


def test_an_updater_that_raises_fails_the_keys_pulls_with_its_error_and_the_server_goes_on():
    store, replies = ServerStore(num_workers=1), Replies()
    store.set_updater(lambda key, merged, stored: 1 / 0)
    store.init(1, "w", np.ones(2, np.float32), sync=True, row_size=1)
    shard = store.shard(1)
    store.push(shard, 0, np.ones(2, np.float32), replies.answer)
    store.pull(shard, 0, 7, 0, 1, replies.answer)
    assert replies.answers == [(0, 7, 0, "the updater raised ZeroDivisionError: division by zero (key 'w')")]


def test_refusals_name_the_key_and_the_sizes():
    store = ServerStore(num_workers=1)
    store.init(1, "w", np.ones(2, np.float32), sync=True, row_size=1)
    with pytest.raises(RequestRefused, match="key 'w' is already initialised"):
        store.init(1, "w", np.ones(2, np.float32), sync=True, row_size=1)
    with pytest.raises(RequestRefused, match="key id 0x9 was never initialised"):
        store.shard(9)
    error = store.wrong_size(store.shard(1), 0, 32)
    assert str(error) == "key 'w': a push of 32 bytes, but this server holds 8"
    assert store.shard(1).round.received == [1]  # counted: later pulls do not wait for it


def test_async_keys_need_an_updater_and_apply_every_push():
    store, replies = ServerStore(num_workers=2), Replies()
    store.init(1, "w", np.zeros(2, np.float32), sync=False, row_size=1)
    with pytest.raises(RequestRefused, match="dist_async needs an optimizer"):
        store.push(store.shard(1), 0, np.ones(2, np.float32), replies.answer)
    store.set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    for _ in range(3):
        store.push(store.shard(1), 1, np.ones(2, np.float32), replies.answer)
    assert store.shard(1).stored.tolist() == [3.0, 3.0]


def test_a_pull_on_a_round_a_finished_worker_never_pushed_is_refused_naming_it():
    store, replies = ServerStore(num_workers=2), Replies()
    store.init(1, "w", np.zeros(2, np.float32), sync=True, row_size=1)
    shard = store.shard(1)
    store.push(shard, 0, np.ones(2, np.float32), replies.answer)
    store.finished[1] = "worker 1 on 127.0.0.1:5"
    with pytest.raises(RequestRefused, match="round of key 'w' can never close: worker 1 on 127.0.0.1:5"):
        store.pull(shard, 0, 3, 0, 1, replies.answer)


def test_row_pulls_return_the_rows_and_refuse_ids_outside_the_shard():
    store = ServerStore(num_workers=1)
    store.init(1, "emb", np.arange(12, dtype=np.float32).reshape(4, 3), sync=True, row_size=3)
    assert store.rows(store.shard(1), np.array([3, 0])).tolist() == [[9, 10, 11], [0, 1, 2]]
    with pytest.raises(RequestRefused, match="row ids outside 0..3"):
        store.rows(store.shard(1), np.array([4]))


def _group_message(keys, values):
    entries = np.zeros(len(keys), dtype=ENTRY)
    entries["key"] = keys
    entries["index"] = np.arange(len(keys))
    entries["nbytes"] = 4
    entries["offset"] = np.arange(len(keys)) * 4
    entries["seq"] = 1
    return entries, np.asarray(values, np.float32)


def test_a_key_list_pushed_together_is_one_group_and_dissolves_back_to_exact_per_key_rounds():
    keys = list(range(100, 100 + MIN_GROUP))
    store, replies = ServerStore(num_workers=2), Replies()
    groups = Groups(store, replies)
    for k in keys:
        store.init(k, k, np.zeros(1, np.float32), sync=True, row_size=1)
    entries, payload = _group_message(keys, np.arange(MIN_GROUP))
    assert groups.try_push(0, entries.tobytes(), [payload.tobytes()])
    group = next(iter(groups.by_keys.values()))
    assert all(store.shard(k).group is group for k in keys) and group.round.count == 1
    # a pull of one key alone takes the key off the fast path, with the round's progress
    groups.dissolve(group)
    shard = store.shard(keys[3])
    assert shard.group is None and shard.round.count == 1 and shard.round.first.tolist() == [3.0]
    store.push(shard, 1, np.full(1, 10, np.float32), replies.answer)
    assert shard.stored.tolist() == [13.0]


def test_a_group_round_answers_its_waiting_pull_with_every_keys_sum():
    keys = list(range(MIN_GROUP))
    store, replies = ServerStore(num_workers=2), Replies()
    groups = Groups(store, replies)
    for k in keys:
        store.init(k, k, np.zeros(1, np.float32), sync=True, row_size=1)
    entries, payload = _group_message(keys, np.ones(MIN_GROUP))
    for worker in (0, 1):
        assert groups.try_push(worker, entries.tobytes(), [payload.tobytes()])
        if worker == 0:
            assert groups.try_pull(0, 9, entries.tobytes())  # waits for worker 1's push
            assert replies.sent == []
    (worker, frames), = replies.sent
    assert worker == 0 and np.frombuffer(frames[2], np.float32).tolist() == [2.0] * MIN_GROUP
