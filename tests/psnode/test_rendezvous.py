"""Rendezvous values through the scheduler (NCCL's unique id travels this way): set once, asked by any node."""

import pytest
from psnode_testkit import InProcJob

from psnode.errors import ProtocolError, PSNodeError
from psnode.node.protocol import Cmd
from psnode.scheduler.rendezvous import MAX_KEYS, MAX_VALUE, Rendezvous

pytestmark = pytest.mark.unit


def ask(worker, cmd, body, timeout=10):
    future = worker.conn.link.ask(cmd, body=body)
    assert worker.wait_for(future, timeout), "the scheduler did not answer"
    return future.result()


def test_a_value_asked_for_before_it_is_set_is_answered_once_it_is():
    with InProcJob(num_workers=2, num_servers=0) as job:
        w0, w1 = job.workers
        waiting = w1.conn.link.ask(Cmd.RDV_GET, body={"key": "id"})
        assert not w1.wait_for(waiting, 0.2)  # nothing set yet: it waits
        assert ask(w0, Cmd.RDV_SET, {"key": "id", "value": "[1, 2, 3]"}) == "[1, 2, 3]"
        assert w1.wait_for(waiting, 10) and waiting.result() == "[1, 2, 3]"
        assert ask(w1, Cmd.RDV_GET, {"key": "id"}) == "[1, 2, 3]"  # and later asks at once


def test_a_key_set_twice_to_another_value_and_malformed_requests_are_refused_with_a_sentence():
    with InProcJob(num_workers=1, num_servers=0) as job:
        w0 = job.workers[0]
        ask(w0, Cmd.RDV_SET, {"key": "k", "value": "a"})
        assert ask(w0, Cmd.RDV_SET, {"key": "k", "value": "a"}) == "a"  # the same value again is harmless
        with pytest.raises(PSNodeError, match="already set to another value"):
            ask(w0, Cmd.RDV_SET, {"key": "k", "value": "b"})
        with pytest.raises(PSNodeError, match="is a int, not a string"):
            ask(w0, Cmd.RDV_SET, {"key": 5, "value": "b"})
        with pytest.raises(PSNodeError, match=f"at most {MAX_VALUE}"):
            ask(w0, Cmd.RDV_SET, {"key": "big", "value": "x" * (MAX_VALUE + 1)})
        assert job.scheduler.malformed >= 3


def test_the_number_of_keys_is_bounded():
    table = Rendezvous()
    for i in range(MAX_KEYS):
        table.set({"key": f"k{i}", "value": "v"})
    with pytest.raises(ProtocolError, match="one too many"):
        table.get(b"node", 1, {"key": "another"})
    assert table.get(b"node", 2, {"key": "k3"}) == "v"
