"""The scheduler's ledger (``psnode.scheduler.ledger``): worker 0 appends, every worker reads from
an index on and waits for more, the end is told once worker 0 finished, and every field from the
network is bounded and checked (a refusal is a sentence the asker raises; the scheduler lives on)."""

import pytest
from psnode_testkit import InProcJob

from psnode.errors import PSNodeError
from psnode.node.control import LedgerPage
from psnode.node.protocol import Cmd
from psnode.scheduler.ledger import MAX_ENTRY, MAX_LOGS, REPLY_BUDGET, Ledger

pytestmark = pytest.mark.unit


def result(worker, future, timeout=10):
    assert worker.wait_for(future, timeout), "the scheduler did not answer"
    return future.result()


def test_a_read_past_the_end_waits_for_worker_0s_next_entry_and_later_reads_are_answered_at_once():
    with InProcJob(num_workers=3, num_servers=0) as job:
        w0, w1, w2 = job.workers
        waiting = w1.ledger_read("placement/0", 0, wait=True)
        assert not w1.wait_for(waiting, 0.2)  # nothing appended yet: it waits
        assert result(w0, w0.ledger_append("placement/0", b"first")) == 0
        assert result(w1, waiting) == LedgerPage(0, [b"first"], False)
        assert result(w0, w0.ledger_append("placement/0", b"second")) == 1
        assert result(w2, w2.ledger_read("placement/0", 0, wait=True)) == LedgerPage(0, [b"first", b"second"], False)
        assert result(w2, w2.ledger_read("placement/0", 1, wait=False)) == LedgerPage(1, [b"second"], False)
        assert result(w2, w2.ledger_read("placement/0", 2, wait=False)) == LedgerPage(2, [], False)
        assert result(w2, w2.ledger_read("placement/1", 0, wait=False)) == LedgerPage(0, [], False)  # logs are apart


def test_reads_waiting_when_worker_0_finishes_are_told_the_log_ended():
    with InProcJob(num_workers=2, num_servers=0) as job:
        w0, w1 = job.workers
        result(w0, w0.ledger_append("log", b"only"))
        waiting = w1.ledger_read("log", 1, wait=True)
        assert not w1.wait_for(waiting, 0.2)
        w0.close()
        assert result(w1, waiting) == LedgerPage(1, [], True)
        assert result(w1, w1.ledger_read("log", 0, wait=True)) == LedgerPage(0, [b"only"], True)


def test_only_worker_0_appends_and_malformed_requests_are_refused_with_a_sentence_the_scheduler_survives():
    with InProcJob(num_workers=2, num_servers=1) as job:
        w0, w1 = job.workers
        with pytest.raises(PSNodeError, match="worker 1 .*may not append to the ledger; worker 0 writes it"):
            result(w1, w1.ledger_append("log", b"x"))
        with pytest.raises(PSNodeError, match=f"a ledger entry of {MAX_ENTRY + 1} bytes for log 'log' \\(at most {MAX_ENTRY}\\)"):
            result(w0, w0.ledger_append("log", b"x" * (MAX_ENTRY + 1)))
        with pytest.raises(PSNodeError, match="'log' is a int, not a non-empty string"):
            result(w0, w0.conn.link.ask(Cmd.LEDGER_READ, body={"log": 5}))
        with pytest.raises(PSNodeError, match="from index -3"):
            result(w0, w0.conn.link.ask(Cmd.LEDGER_READ, arg=-3, body={"log": "log"}))
        with pytest.raises(PSNodeError, match="'wait' is a str, not a boolean"):
            result(w0, w0.conn.link.ask(Cmd.LEDGER_READ, body={"log": "log", "wait": "yes"}))
        with pytest.raises(PSNodeError, match="a ledger append of 2 frames, expected 3"):
            result(w0, w0.conn.link.ask(Cmd.LEDGER_APPEND, body={"log": "log"}))
        with pytest.raises(PSNodeError, match="control body is not JSON"):
            result(w0, w0.conn.link.ask(Cmd.LEDGER_READ, data=(b"\xff garbage",)))  # the body frame
        assert job.scheduler.malformed >= 7
        assert result(w0, w0.ledger_append("log", b"after")) == 0  # and it goes on


def test_a_reply_carries_at_most_its_budget_of_entries_and_the_reader_reads_on_for_the_rest():
    ledger = Ledger()
    for _ in range(3):
        ledger.append({"log": "l"}, b"x" * MAX_ENTRY)
    answer = ledger.read(b"n", 1, {"log": "l"}, 0)
    assert len(answer.entries) == REPLY_BUDGET // MAX_ENTRY < 3 and not answer.end
    assert len(ledger.read(b"n", 2, {"log": "l"}, len(answer.entries)).entries) == 3 - len(answer.entries)


def test_the_number_of_logs_is_bounded():
    ledger = Ledger()
    for i in range(MAX_LOGS):
        ledger.append({"log": f"l{i}"}, b"")
    with pytest.raises(Exception, match=f"one too many: a job holds at most {MAX_LOGS}"):
        ledger.read(b"n", 1, {"log": "another"}, 0)
