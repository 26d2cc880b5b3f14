"""The receiving role of a worker handed from its network thread to a waiting caller
(psnode.worker.receiver), on a real in-process job: a reply the network thread took while handing
the role over ends the caller's wait at once: its receiving turn takes what came, waiting for nothing."""

import concurrent.futures
import threading
import time

import pytest
from psnode_testkit import InProcJob

pytestmark = pytest.mark.unit


def test_a_caller_whose_reply_came_while_it_took_the_role_over_returns_without_waiting_for_another_message():
    with InProcJob(num_workers=1, num_servers=1) as job:
        worker = job.workers[0]
        receiver = worker.receiver
        turns: list[tuple[bool, float]] = []  # each caller's receiving turn: its future done then, how long it may wait
        process = worker.conn.process

        def counted(timeout, until=None):
            if until is not None:
                turns.append((until.done(), timeout))
            return process(timeout, until)

        worker.conn.process = counted
        future: concurrent.futures.Future = concurrent.futures.Future()
        receiver._lock.acquire()  # this test plays the network thread, in the middle of its turn
        receiver._owner = threading.get_ident()
        waited = []
        caller = threading.Thread(target=lambda: waited.append(receiver.wait_for(future, 10)), daemon=True)
        caller.start()
        deadline = time.monotonic() + 10
        while receiver._caller is None:  # the caller asked for the role; it waits for the turn to end
            assert time.monotonic() < deadline, "the caller never asked for the receiving role"
            caller.join(0.001)
        future.set_result(None)  # the turn dispatched the caller's reply
        receiver._owner = None
        receiver._lock.release()
        caller.join(10)
        assert waited == [True]
        # it took what had come already, without waiting for another message
        assert all(timeout == 0 for done, timeout in turns if done) and turns, turns
