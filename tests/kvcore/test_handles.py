"""kvcore.handles.LazyHandle behaves as a concurrent.futures.Future, whichever thread waits and when."""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import time

import pytest

from kvcore.handles import KVTimeoutError, LazyHandle

pytestmark = pytest.mark.unit


def test_a_completed_handle_answers_every_future_question():
    handle = LazyHandle("pull")
    assert not handle.done() and handle.running() is False
    handle.set_result(7)
    assert handle.done() and handle.result() == 7 and handle.wait() == 7 and handle.exception() is None
    seen = []
    handle.add_done_callback(seen.append)  # already done: runs at once
    assert seen == [handle]
    with pytest.raises(concurrent.futures.InvalidStateError):
        handle.set_result(8)
    assert handle.result(0) == 7


def test_an_error_is_raised_by_wait_and_result_and_a_second_completion_is_refused():
    handle = LazyHandle("push")
    handle.set_exception(ValueError("refused by server 0"))
    for call in (handle.wait, handle.result):
        with pytest.raises(ValueError, match="refused by server 0"):
            call()
    assert isinstance(handle.exception(), ValueError)
    with pytest.raises(concurrent.futures.InvalidStateError):
        handle.set_exception(ValueError("again"))


def test_wait_times_out_with_the_stores_error_and_callbacks_run_once_on_completion():
    handle = LazyHandle("pull of key 3")
    with pytest.raises(KVTimeoutError, match="pull of key 3 did not complete within 0.01 s"):
        handle.wait(0.01)
    seen = []
    handle.add_done_callback(seen.append)
    handle.set_result(None)
    assert seen == [handle]


@pytest.mark.parametrize("how", ["result", "wait", "futures.wait", "callback", "exception"])
def test_a_thread_waiting_at_the_moment_of_completion_always_wakes(how):
    # the waiter makes the condition while the completing thread may be between writing the state
    # and looking for a condition: every interleaving must end with the waiter seeing the value
    jobs: queue.Queue = queue.Queue()
    outcomes: queue.Queue = queue.Queue()

    def waiter():
        while True:
            item = jobs.get()
            if item is None:
                return
            handle, value = item
            try:
                if how == "result":
                    got = handle.result(5)
                elif how == "wait":
                    got = handle.wait(5)
                elif how == "futures.wait":
                    done, _ = concurrent.futures.wait([handle], 5)
                    got = handle.result(0) if done else "timed out"
                elif how == "exception":
                    got = handle.exception(5)
                    got = int(str(got))
                else:
                    fired = threading.Event()
                    handle.add_done_callback(lambda h: fired.set())
                    got = handle.result(0) if fired.wait(5) else "no callback"
                outcomes.put(got == value or (handle, value, got))
            except Exception as exc:  # reported below, with the round it happened in
                outcomes.put((value, repr(exc)))

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost every two steps: every order occurs
    try:
        for value in range(2000):
            handle = LazyHandle("race")
            jobs.put((handle, value))
            if value % 2:
                time.sleep(0)  # let the waiter get there first every other round
            if how == "exception":
                handle.set_exception(RuntimeError(str(value)))
            else:
                handle.set_result(value)
        results = [outcomes.get(timeout=30) for _ in range(2000)]
    finally:
        sys.setswitchinterval(interval)
        for _ in threads:
            jobs.put(None)
        for thread in threads:
            thread.join(10)
    failures = [r for r in results if r is not True]
    assert not failures, failures[:5]


def test_a_waiter_that_arrives_between_the_state_and_the_condition_check_is_woken():
    # the narrowest interleaving, made deterministic: the waiters block on a condition that did not
    # exist when completion began; completion then finds it and wakes them (LazyHandle._notify_late)
    handle = LazyHandle("pull")
    got = []
    threads = [threading.Thread(target=lambda: got.append(handle.result(5))),
               threading.Thread(target=lambda: got.append(len(concurrent.futures.wait([handle], 5).done)))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while (handle._lazy_condition is None or len(handle._lazy_condition._waiters) < 1 or not handle._waiters) \
            and time.monotonic() < deadline:
        time.sleep(0.001)
    handle._result, handle._state = 42, "FINISHED"  # what set_result writes before looking for a condition
    handle._notify_late("add_result")
    for thread in threads:
        thread.join(5)
    assert sorted(got) == [1, 42]
