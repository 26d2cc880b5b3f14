"""The priority work queues and worker threads behind the shared model's push and pull threads."""

from __future__ import annotations

import threading

import pytest

from kvcore.shared_model.queues import PriorityWorkQueue, QueueClosed, WorkerThread

pytestmark = pytest.mark.unit


def test_queue_hands_out_highest_priority_first_and_fifo_among_equals():
    queue = PriorityWorkQueue()
    for item, priority in [("a", 0), ("b", 2), ("c", 0), ("d", 2), ("e", -1), ("f", 7)]:
        queue.put(item, priority)
    assert [queue.get(1) for _ in range(6)] == ["f", "b", "d", "a", "c", "e"]
    assert queue.get(0.01) is None


def test_closed_queue_returns_waiting_items_and_refuses_new_ones():
    queue = PriorityWorkQueue()
    queue.put("x", 1)
    queue.put("y", 3)
    assert queue.close() == ["y", "x"]
    assert queue.get(0.01) is None
    with pytest.raises(QueueClosed):
        queue.put("z")


def test_worker_runs_work_queued_while_it_was_busy_in_priority_order():
    order, errors = [], []
    started, release = threading.Event(), threading.Event()
    worker = WorkerThread("test-worker", PriorityWorkQueue(), lambda item, exc: errors.append(exc))
    worker.start()
    try:
        worker.queue.put(lambda: (started.set(), release.wait(10)))
        assert started.wait(10)
        for name, priority in [("low", 0), ("high", 9), ("mid", 4), ("high2", 9)]:
            worker.queue.put(lambda name=name: order.append(name), priority)
        done = threading.Event()
        worker.queue.put(done.set, -100)
        release.set()
        assert done.wait(10)
    finally:
        worker.queue.close()
        assert worker.join(5)
    assert order == ["high", "high2", "mid", "low"]
    assert errors == []


def test_worker_reports_a_failing_item_and_keeps_running():
    failures = []
    worker = WorkerThread("test-worker", PriorityWorkQueue(), lambda item, exc: failures.append(str(exc)))
    worker.start()
    done = threading.Event()
    try:
        worker.queue.put(lambda: 1 / 0)
        worker.queue.put(done.set)
        assert done.wait(10)
    finally:
        worker.queue.close()
        assert worker.join(5)
    assert failures == ["division by zero"]
