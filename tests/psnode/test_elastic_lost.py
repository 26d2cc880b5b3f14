"""How one worker of an elastic job counts a lost worker (``psnode.worker.elastic``): it counts it until
the last round its servers name (the lowest of them), whether the scheduler's word or a server's
comes first, and a joiner that takes the lost worker's rank counts from its own start round. The rules
alone, on a worker whose place (the latest round it pushed to) the test sets; the whole of it with
real processes is in tests/launcher/test_elastic_membership.py."""

from types import SimpleNamespace

import pytest

from psnode.node.membership import Membership
from psnode.worker.elastic import ElasticMembers

pytestmark = pytest.mark.unit


class _Worker(SimpleNamespace):
    """What ``ElasticMembers`` reads of its worker: rank 0 of 3 workers, 2 servers, pushed up to ``at``."""

    def __init__(self) -> None:
        members = Membership("worker")
        members.rank = 0
        super().__init__(rank=0, num_servers=2, env=SimpleNamespace(num_workers=3),
                         conn=SimpleNamespace(members=members), requests=SimpleNamespace(push_counts={}),
                         before_close=lambda close: None)

    @property
    def num_workers(self) -> int:
        return self.env.num_workers - len(self.conn.members.left)

    def at(self, reached: int) -> None:
        self.requests.push_counts = {7: reached}


def _lost(worker: _Worker, elastic: ElasticMembers, rank: int, version: int) -> None:
    """The scheduler's word (``WORKER_LEFT`` of a dropped worker), as ``ControlLink`` takes it."""
    elastic.on_lost(rank, version)
    worker.conn.members.change(rank, False, version)


def test_a_lost_worker_counts_until_the_lowest_last_round_its_servers_name():
    worker = _Worker()
    elastic = ElasticMembers(worker)
    worker.at(4)
    _lost(worker, elastic, 2, 1)
    assert elastic.members_next() == (0, 1, 2)  # no server named its last round yet: it counts
    elastic._named(2, 1, 8)
    worker.at(6)
    assert elastic.members_next() == (0, 1, 2)  # round 7
    elastic._named(2, 1, 7)  # the other server names an earlier one: the lowest counts
    assert elastic.members_next() == (0, 1, 2)  # round 7
    worker.at(7)
    assert elastic.members_next() == (0, 1)  # round 8, and on: the loss is let go, the book says the rest
    assert not elastic.lost
    worker.at(20)
    assert elastic.members_next() == (0, 1)


def test_a_servers_notice_may_come_before_the_schedulers_word():
    worker = _Worker()
    elastic = ElasticMembers(worker)
    worker.at(3)
    elastic._named(2, 1, 5)
    assert elastic.members_next() == (0, 1, 2)
    worker.at(5)
    assert elastic.members_next() == (0, 1)  # round 6: out, though the book does not say it left yet
    _lost(worker, elastic, 2, 1)
    elastic._named(2, 1, 6)  # the other server's, late: the lowest still counts
    assert elastic.members_next() == (0, 1) and not elastic.lost


def test_servers_without_sync_keys_name_no_round_and_when_none_does_it_is_out_at_once():
    worker = _Worker()
    elastic = ElasticMembers(worker)
    worker.at(3)
    _lost(worker, elastic, 1, 1)
    elastic._named(1, 1, None)
    assert elastic.members_next() == (0, 1, 2)  # one server has no round to name; the other may
    elastic._named(1, 1, None)
    assert elastic.members_next() == (0, 2)


def test_a_joiner_that_takes_the_lost_workers_rank_counts_from_its_start_the_lost_one_until_its_last():
    worker = _Worker()
    elastic = ElasticMembers(worker)
    worker.at(4)
    _lost(worker, elastic, 2, 1)
    # the join's word (change 2, start round 10) may come before a server named the lost one's last round
    elastic._joined({"rank": 2, "start": 10, "version": 2, "provider": 1}, "a test")
    assert elastic.members_next() == (0, 1, 2)  # round 5: the lost worker still counts
    elastic._named(2, 1, 7)
    worker.at(6)
    assert elastic.members_next() == (0, 1, 2)  # round 7: its last
    worker.at(7)
    assert elastic.members_next() == (0, 1)  # rounds 8, 9: neither
    worker.at(9)
    assert elastic.members_next() == (0, 1, 2) and not elastic.lost  # round 10: the joiner
    _lost(worker, elastic, 2, 3)  # the joiner is lost in turn: a new loss of that rank
    elastic._named(2, 1, 4)  # a late notice of the earlier one changes nothing
    assert elastic.members_next() == (0, 1, 2)
    elastic._named(2, 3, 12)
    elastic._named(2, 3, 12)
    worker.at(12)
    assert elastic.members_next() == (0, 1)


def test_a_leaver_that_is_lost_after_it_announced_its_last_round_counts_until_that_round():
    worker = _Worker()
    elastic = ElasticMembers(worker)
    worker.at(4)
    elastic.going = {2: 5}  # its LEAVING: round 5 is its last
    _lost(worker, elastic, 2, 1)  # lost before it left
    assert elastic.members_next() == (0, 1, 2)  # round 5
    worker.at(5)
    assert elastic.members_next() == (0, 1)  # round 6: the announced last round holds, though no server named one
