"""Marks and versioned rounds, the parts of a dist_sync worker replaced in place (psnode.server.marks,
psnode.server.store's replay): what a MARK may hold (it comes from the network), which marks a server
keeps and how far back it keeps values, how a replacement picks its mark, and a store that drops a
redone push and answers a redone pull with the value after its round."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psnode.errors import ProtocolError, RequestRefused
from psnode.node.protocol import MARK_COUNT, pack_counts
from psnode.server.marks import KEPT, Mark, Marks, marks_reply, read_mark
from psnode.server.store import PastValue, ServerStore
from psnode.worker.node import common_mark, taken_counts
from psnode.worker.requests import RequestTable

pytestmark = pytest.mark.unit


class Frame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def mark_frames(head, counts: dict[int, int] | bytes):
    body = head if isinstance(head, bytes) else json.dumps(head).encode()
    return [Frame(body), Frame(counts if isinstance(counts, bytes) else pack_counts(counts))]


def test_a_mark_reads_back_its_id_scalars_barriers_and_counts():
    mark = read_mark(mark_frames({"id": 3, "scalars": {"step": 7}, "barriers": {"1": 2},
                                  "setup": {"set_optimizer#0:0": 1}}, {9: 4, 2: 5}), 10)
    assert (mark.id, json.loads(mark.scalars), mark.barriers, mark.setup) == (3, {"step": 7}, {"1": 2},
                                                                             {"set_optimizer#0:0": 1})
    assert (mark.count(2), mark.count(9), mark.count(5)) == (5, 4, 0)


@pytest.mark.parametrize("frames, expected", [
    ([Frame(b"{}")], r"a MARK of 2 frames, expected 3"),
    (mark_frames(b"{not json", {}), r"a MARK's JSON does not parse"),
    (mark_frames(b"x" * (70 << 10), {}), r"a MARK's JSON of 71680 bytes"),
    (mark_frames({"id": 0, "scalars": {}}, {}), r"a MARK's id 0 is not a positive integer"),
    (mark_frames({"id": True, "scalars": {}}, {}), r"a MARK's id True is not a positive integer"),
    (mark_frames({"id": "7", "scalars": {}}, {}), r"a MARK's id '7' is not a positive integer"),
    (mark_frames({"id": 1, "scalars": [1]}, {}), r"a MARK's scalars are a list, not an object"),
    (mark_frames({"id": 1, "scalars": {}, "barriers": {"9": 1}}, {}), r"barrier counts .* are not a count per group"),
    (mark_frames({"id": 1, "scalars": {}, "barriers": {"1": -1}}, {}), r"barrier counts .* are not a count per group"),
    (mark_frames({"id": 1, "scalars": {}, "setup": {"x": 0}}, {}), r"set-up barriers .* are not at most 64 names"),
    (mark_frames({"id": 1, "scalars": {}, "setup": {str(i): 1 for i in range(65)}}, {}), r"set-up barriers"),
    (mark_frames({"id": 1, "scalars": {}, "setup": {"x" * 81: 1}}, {}), r"set-up barriers"),
    (mark_frames({"id": 1, "scalars": {}}, b"\x00" * 15), r"counts of 15 bytes are not at most 4 records of 16 bytes"),
    (mark_frames({"id": 1, "scalars": {}}, {k: 1 for k in range(5)}), r"counts of 80 bytes are not at most 4 records"),
    (mark_frames({"id": 1, "scalars": {}}, {1: 1 << 63}), r"counts more than 2\*\*62 pushes"),
])
def test_a_malformed_mark_is_refused_naming_what_is_wrong(frames, expected):
    with pytest.raises(ProtocolError, match=expected):
        read_mark(frames, 4)


def mark(mark_id, counts):
    out = np.empty(len(counts), MARK_COUNT)
    out["key"], out["seq"] = list(counts), list(counts.values())
    return Mark(mark_id, json.dumps({"step": mark_id}), out)


def test_a_server_keeps_each_workers_newest_marks_and_a_replacements_marks_supersede_its_predecessors():
    marks = Marks()
    for i in range(1, 5):
        marks.add(0, mark(i, {7: i}))
    assert [m.id for m in marks.of(0)] == [3, 4][-KEPT:]
    marks.add(0, mark(4, {7: 40}))  # the replacement resumed at mark 3: its next mark is 4 again
    assert [(m.id, m.count(7)) for m in marks.of(0)] == [(3, 3), (4, 40)]
    marks.add(0, mark(2, {7: 2}))  # an older id drops every mark at or above it
    assert [m.id for m in marks.of(0)] == [2]


def test_the_floor_is_the_oldest_kept_count_of_any_worker_still_in_the_job():
    marks = Marks()
    assert marks.floor(7, [0, 1]) is None  # nobody marks: nothing is kept for a replacement
    marks.add(0, mark(1, {7: 5}))
    assert marks.floor(7, [0, 1]) == 0  # worker 1 has no mark yet: it may be replaced from the start
    marks.add(1, mark(1, {7: 4}))
    marks.add(1, mark(2, {7: 6}))
    assert marks.floor(7, [0, 1]) == 4 and marks.floor(8, [0, 1]) == 0
    marks.forget(1)
    assert marks.floor(7, [0]) == 5


def test_a_servers_answer_lists_versioned_counts_only_and_whether_every_counted_push_arrived():
    listed, frames = marks_reply([mark(1, {7: 3, 8: 9}), mark(2, {7: 5, 8: 9})],
                                 received={7: 4, 8: 9}.get, versioned=lambda key: key == 7)
    assert [(m["id"], m["complete"]) for m in listed] == [(1, True), (2, False)]
    assert [np.frombuffer(f, MARK_COUNT).tolist() for f in frames] == [[(7, 3)], [(7, 5)]]


def test_a_replacement_takes_the_newest_mark_every_server_holds_complete():
    def listing(*marks):
        return [{"id": i, "scalars": {"step": i}, "barriers": {"1": i}, "setup": {"set_optimizer#0:0": 1},
                 "complete": complete} for i, complete in marks]
    counts = pack_counts({7: 1})
    replies = [(0, listing((3, True), (4, True)), [counts, counts]), (1, listing((3, True), (4, False)), [counts, counts])]
    chosen = common_mark(replies, 2)
    assert (chosen.id, chosen.scalars, chosen.barriers, chosen.setup, sorted(chosen.counts)) == (
        3, {"step": 3}, {"1": 3}, {"set_optimizer#0:0": 1}, [0, 1])
    assert common_mark([(0, listing((3, True)), [counts])], 2) is None  # a server without it: none in common
    with pytest.raises(ProtocolError, match="server 0 listed a malformed mark"):
        common_mark([(0, [{"id": "x"}], [counts])], 1)



def test_a_replacement_is_caught_up_at_its_first_push_its_predecessor_had_not_sent():
    # the predecessor died mid-push: server 0 took 5 pushes of key 7, server 1 only 4 of key 8
    taken = taken_counts([(0, [], [pack_counts({7: 5})]), (1, [], [pack_counts({8: 4})])])
    assert taken == {(7, 0): 5, (8, 1): 4}
    with pytest.raises(ProtocolError, match="server 1 sent taken counts of 7 bytes"):
        taken_counts([(1, [], [b"1234567"])])

    class Latch:
        error = None
    table, told = RequestTable(Latch()), []
    table.push_counts.update({(7, 0): 4, (8, 1): 4})  # resumed at a mark of 4 pushes each
    table.redo_until(taken, lambda: told.append("caught up"))
    assert table.next_push(7, 0, 12) == 5 and told == []  # redone: server 0 took it already
    assert table.next_push(8, 1, 12) == 5 and told == ["caught up"]  # new: the round the others wait on
    table.next_push(7, 0, 12)
    table.caught_up()
    assert told == ["caught up"]  # once


def test_a_replacement_with_nothing_new_to_push_is_caught_up_when_it_finishes():
    class Latch:
        error = None
    table, told = RequestTable(Latch()), []
    table.push_counts[(7, 0)] = 3
    table.redo_until({(7, 0): 5}, lambda: told.append("caught up"))
    table.next_push(7, 0, 12)
    table.next_push(7, 0, 12)
    assert told == []
    table.caught_up()  # WorkerNode.close: it redid its steps to the end
    assert told == ["caught up"]


# ---- the store under replay -----------------------------------------------------------------------
def replay_store(workers=2):
    store = ServerStore(workers)
    store.replay = True
    store.init(7, "w", np.zeros(3, np.float32), sync=True, row_size=1)
    return store, store.shards[7]


def answers():
    got = []

    def answer(worker, req_id, index, value):
        got.append((worker, req_id, np.array(value.stored).tolist(), type(value).__name__))
    return got, answer


def push_round(store, shard, value, seqs):
    for worker, seq in seqs.items():
        store.push(shard, worker, np.full(3, value, np.float32), lambda *a: None, seq=seq)


def test_a_versioned_store_drops_a_redone_push_and_answers_a_redone_pull_with_the_value_after_its_round():
    store, shard = replay_store()
    store.add_mark(0, mark(1, {7: 0}))
    store.add_mark(1, mark(1, {7: 0}))
    push_round(store, shard, 1.0, {0: 1, 1: 1})  # round 1: the sum 2 replaces the value (no updater)
    push_round(store, shard, 10.0, {0: 2, 1: 2})  # round 2: 20
    assert shard.round.closed == 2 and sorted(shard.history) == [0, 1]
    store.worker_rejoined(1)  # worker 1 replaced: it counts on from its mark (0 pushes)
    assert shard.round.received == [2, 2]
    got, answer = answers()
    store.pull(shard, 1, 5, 0, 0, answer)  # its first pull: the value its predecessor started from
    store.push(shard, 1, np.full(3, 99, np.float32), answer, seq=1)  # redone: dropped
    store.pull(shard, 1, 6, 0, 1, answer)
    assert got == [(1, 5, [0.0] * 3, "PastValue"), (1, 6, [2.0] * 3, "PastValue")]
    assert shard.round.received == [2, 2] and shard.round.count == 0
    push_round(store, shard, 100.0, {0: 3})  # round 3 waits for the replacement
    store.push(shard, 1, np.full(3, 10.0, np.float32), answer, seq=2)  # redone: dropped
    store.pull(shard, 1, 7, 0, 3, answer)  # waits for round 3
    assert len(got) == 2
    store.push(shard, 1, np.full(3, 100.0, np.float32), answer, seq=3)  # new: closes round 3
    assert got[2] == (1, 7, [200.0] * 3, "Shard")


def test_values_older_than_every_workers_oldest_kept_mark_are_let_go_and_a_pull_of_one_is_refused():
    store, shard = replay_store()
    for r in range(1, 6):
        for worker in (0, 1):
            store.add_mark(worker, mark(r, {7: r - 1}))
        push_round(store, shard, float(r), {0: r, 1: r})
    assert sorted(shard.history) == [3, 4]  # the oldest kept marks count 3 pushes (KEPT = 2)
    assert store.kept_bytes == 2 * shard.nbytes
    with pytest.raises(RequestRefused, match=r"key 'w': a pull of round 1 cannot be answered exactly, this server keeps "
                                             r"rounds 3\.\.5 only"):
        store.value_after(shard, 1)
    assert isinstance(store.value_after(shard, 3), PastValue) and store.value_after(shard, 5) is shard


def test_without_marks_a_versioned_store_keeps_nothing_and_a_finished_worker_holds_nothing_back():
    store, shard = replay_store()
    push_round(store, shard, 1.0, {0: 1, 1: 1})
    assert shard.history == {} and store.kept_bytes == 0  # nobody marks: no replacement could use it
    store.add_mark(0, mark(1, {7: 1}))
    store.finished[1] = "worker 1"  # finished: it will not be replaced, its missing mark holds nothing
    store.marks.forget(1)
    push_round(store, shard, 1.0, {0: 2, 1: 2})
    assert sorted(shard.history) == [1]


class Keep:
    """An updater the servers unpickle (module level), known by its name."""

    def __init__(self, name):
        self.name = name

    def __call__(self, key, merged, stored):
        stored[:] = merged


# ---- what a worker 0 replaced in place redoes of its predecessor's set-up (FLAG_REDO) ----------------
def test_a_replaced_worker_0_redoes_an_init_and_an_optimizer_its_predecessor_may_have_sent_without_undoing_them():
    from testkit import InProcJob

    def value():
        return np.arange(4, dtype=np.float32)

    with InProcJob(1, 1, settings={"PSLAUNCH_RESTART_SCOPE": "worker"}) as job:
        worker, server = job.workers[0], job.servers[0]

        def call(future):
            worker.wait_for(future, 10)
            return future.exception()
        assert call(worker.init([(0, 7, "w", value(), 1)], True)) is None
        assert call(worker.set_updater(Keep("first"))) is None
        server.store.shards[7].stored[:] = 5.0  # trained on meanwhile
        # the predecessor's init and optimizer arrived: the redo keeps both (the value, the updater)
        assert call(worker.init([(0, 7, "w", value(), 1), (0, 8, "b", value(), 1)], True, redo=True)) is None
        assert call(worker.set_updater(Keep("second"), redo=True)) is None
        assert server.store.shards[7].stored.tolist() == [5.0] * 4 and 8 in server.store.shards
        assert server.store.updater.name == "first"
        # not a redo: a key is initialised once; a redo of another dtype is refused, naming both
        assert "already initialised" in str(call(worker.init([(0, 7, "w", value(), 1)], True)))
        error = call(worker.init([(0, 7, "w", np.arange(4, dtype=np.float64), 1)], True, redo=True))
        assert "initialised again with 4 values of float64, but this server holds 4 values of float32" in str(error)
