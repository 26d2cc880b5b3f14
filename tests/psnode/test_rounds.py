"""The round machine alone: merging, closing, holding early pushes, and when a pull may be answered."""

import numpy as np
import pytest

from psnode.server.rounds import Round, run_updater
from psnode.server.shard_memory import HostMemory

pytestmark = pytest.mark.unit


def new_round(workers=3, quorum=None, size=4):
    return Round(workers, workers if quorum is None else quorum, HostMemory(), np.zeros(size, np.float32))


def collect(applied):
    def apply(owner, full):
        applied.append(np.array(full.result))
    return apply


def test_a_round_closes_on_the_last_workers_push_and_applies_the_exact_sum_once():
    r, applied = new_round(), []
    assert r.push(0, np.full(4, 1, np.float32)) is False
    assert r.push(2, np.full(4, 10, np.float32)) is False
    assert r.push(1, np.full(4, 100, np.float32)) is True
    r.close(collect(applied), None)
    assert [a.tolist() for a in applied] == [[111.0] * 4]
    assert r.count == 0 and r.pushed == set()


def test_a_round_of_one_worker_applies_its_push_without_copying_it():
    r, seen = new_round(workers=1), []
    data = np.arange(4, dtype=np.float32)
    assert r.push(0, data)
    r.close(lambda owner, full: seen.append(full.result is data), None)
    assert seen == [True]


def test_a_second_push_before_the_round_closes_waits_for_the_next_round():
    r, applied = new_round(workers=2), []
    r.push(0, np.full(4, 1, np.float32))
    r.push(0, np.full(4, 2, np.float32))  # worker 0 again: held for round 2
    assert r.count == 1 and len(r.backlog) == 1
    assert r.push(1, np.full(4, 10, np.float32))
    r.close(collect(applied), None)
    assert [a[0] for a in applied] == [11.0]  # round 2 has begun with the held push
    assert r.count == 1 and r.pushed == {0} and not r.backlog
    assert r.push(1, np.full(4, 20, np.float32))
    r.close(collect(applied), None)
    assert [a[0] for a in applied] == [11.0, 22.0]


def test_held_pushes_of_several_workers_join_the_next_round_in_arrival_order():
    r, applied = new_round(workers=3), []
    r.push(0, np.full(4, 1, np.float32))
    r.push(1, np.full(4, 10, np.float32))
    r.push(0, np.full(4, 2, np.float32))  # held
    r.push(1, np.full(4, 20, np.float32))  # held
    r.push(0, np.full(4, 3, np.float32))  # held for round 3
    assert r.push(2, np.full(4, 100, np.float32))
    r.close(collect(applied), None)
    assert [a[0] for a in applied] == [111.0]
    assert r.count == 2 and r.pushed == {0, 1} and [w for w, _ in r.backlog] == [0]
    assert r.push(2, np.full(4, 200, np.float32))
    r.close(collect(applied), None)
    assert [a[0] for a in applied] == [111.0, 222.0] and r.count == 1 and not r.backlog


def test_a_pull_waits_until_every_push_of_its_worker_is_in_a_closed_round():
    r = new_round(workers=2)
    assert r.ready_for(0, 0)
    assert not r.ready_for(0, 1)  # the push has not arrived yet
    r.push(0, np.ones(4, np.float32))
    assert not r.ready_for(0, 1)  # it sits in the open round
    assert r.ready_for(1, 0)  # worker 1 asked for none of its pushes: the last value will do
    r.wait(0, 1, "pull of worker 0")
    assert r.release() == []
    r.push(1, np.ones(4, np.float32))
    r.close(lambda owner, full: None, None)
    assert r.release() == [(0, "pull of worker 0")] and r.waiting == []


def test_an_async_round_applies_every_push_on_arrival():
    r, applied = new_round(workers=3, quorum=1), []
    for worker, value in [(2, 5), (2, 6), (0, 7)]:
        assert r.push(worker, np.full(4, value, np.float32))
        r.close(collect(applied), None)
    assert [a[0] for a in applied] == [5.0, 6.0, 7.0]
    assert r.received == [1, 0, 2] and r.ready_for(2, 2)


def test_a_borrowed_push_is_copied_not_kept():
    r = new_round(workers=2)
    region = np.full(4, 3, np.float32)
    r.push(0, region, borrowed=True)
    region[:] = -1  # the sender reuses its shared memory
    r.push(1, np.ones(4, np.float32))
    sums = []
    r.close(lambda owner, full: sums.append(full.result.tolist()), None)
    assert sums == [[4.0] * 4]


def test_a_refused_push_still_counts_so_later_pulls_do_not_wait_for_it():
    r = new_round(workers=2)
    r.count_refused(1)
    assert r.received == [0, 1] and r.ready_for(1, 1)


def test_a_round_is_stuck_only_on_finished_workers_that_did_not_push():
    r = new_round(workers=3)
    assert r.stuck_on({2: "worker 2 on h:1"}) == []  # no round open
    r.push(0, np.ones(4, np.float32))
    assert r.stuck_on({}) == []
    assert r.stuck_on({0: "worker 0 on h:1", 2: "worker 2 on h:1"}) == ["worker 2 on h:1"]
    assert new_round(workers=3, quorum=1).stuck_on({2: "w"}) == []  # async rounds never wait


def test_a_slice_of_a_round_keeps_its_progress_for_those_elements():
    r = new_round(workers=2, size=6)
    r.push(0, np.arange(6, dtype=np.float32))
    r.push(0, np.arange(6, dtype=np.float32) * 10)  # backlog
    part = r.slice(2, 4, np.zeros(2, np.float32))
    assert part.count == 1 and part.pushed == {0} and part.received == [2, 0]
    assert part.first.tolist() == [2, 3] and part.backlog[0][1].tolist() == [20, 30]
    assert part.push(1, np.ones(2, np.float32))
    sums = []
    part.close(lambda owner, full: sums.append(full.result.tolist()), None)
    assert sums == [[3.0, 4.0]] and part.first.tolist() == [20, 30]


def test_run_updater_words_the_error_with_the_key():
    def updater(key, merged, stored):
        raise ValueError("no")

    assert run_updater(updater, "w1", None, None) == "the updater raised ValueError: no (key 'w1')"
    assert run_updater(lambda k, m, s: None, "w1", None, None) is None


# ---- an elastic job's joiner --------------------------------------------------------------------------
def _step(r, applied, workers, value):
    full = False
    for w in workers:
        full = r.push(w, np.full(4, value * (w + 1), np.float32))
    if full:
        r.close(collect(applied), None)
    return full


def test_a_joiner_counts_from_its_start_round_its_early_push_waits_and_its_first_pull_sees_the_round_before():
    # workers 0 and 1 are members (quorum 2 of 3 ranks); round 1 closed, worker 0 pushed round 2
    r, applied = new_round(workers=3, quorum=2), []
    assert _step(r, applied, (0, 1), 1)
    r.push(0, np.full(4, 2, np.float32))
    assert r.touched() == 2
    r.join(2, 4)  # the latest round any push reached + 2
    assert not r.ready_for(2, 0)  # its first pull waits for round 3, the one before its start
    assert r.push(1, np.full(4, 4, np.float32))  # round 2 closes with two pushes
    r.close(collect(applied), None)
    assert r.quorum == 2 and not r.ready_for(2, 0)
    r.push(2, np.full(4, 300, np.float32))  # the joiner is quick: its push is for round 4, held
    assert r.count == 0 and len(r.backlog) == 1 and not r.ready_for(2, 0)
    assert _step(r, applied, (0, 1), 3)  # round 3: still the two of them
    assert r.quorum == 3 and r.count == 1 and r.pushed == {2}  # round 4 opened with the joiner's held push
    assert not r.ready_for(2, 1)  # its own push is in the open round 4
    assert _step(r, applied, (0, 1), 4)
    assert [a[0] for a in applied] == [3.0, 6.0, 9.0, 4 + 8 + 300.0]
    assert r.ready_for(2, 1) and not r.starts and not r.changes


def test_a_join_into_an_empty_open_round_counts_the_joiner_at_once():
    r, applied = new_round(workers=3, quorum=2), []
    assert _step(r, applied, (0, 1), 1)
    r.join(2, 2)  # a key pushed less often: its next round no push reached
    assert r.quorum == 3 and r.ready_for(2, 0)
    assert not _step(r, applied, (0, 1), 1) and _step(r, applied, (2,), 1)
    assert [a[0] for a in applied] == [3.0, 6.0]


def test_touched_counts_the_open_round_and_the_rounds_the_backlog_holds():
    r = new_round(workers=2)
    assert r.touched() == 0
    r.push(0, np.ones(4, np.float32))
    r.push(0, np.ones(4, np.float32))
    r.push(0, np.ones(4, np.float32))
    assert r.touched() == 3
