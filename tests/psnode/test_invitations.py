"""Pushes by invitation: a server lets at most ``PSLAUNCH_PUSH_WINDOW`` bytes of big pushes in at once.

The state machine alone (``psnode.server.invitations``), then real workers and a real server on the
inproc transport: who offers, the sums of rounds that went by invitation, the window never exceeded,
and offers or invitations that are wrong (refused, or counted as malformed, and nothing waits).
"""

import concurrent.futures
import contextlib

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys, on_threads, sent_headers

from psnode.errors import RemoteError
from psnode.node.protocol import ENTRY_STRUCT, FLAG_OFFER, Cmd, pack_header
from psnode.server.invitations import Invitations

pytestmark = pytest.mark.unit

VALUES = 65536  # float32: 256 KiB, a part that travels in a message of its own over the network


class Recorder:
    def __init__(self, window: int) -> None:
        self.sent: list[tuple[int, int, int]] = []
        self.invitations = Invitations(window, lambda *invite: self.sent.append(invite))


def test_offers_are_invited_in_arrival_order_while_their_bytes_fit_the_window():
    rec = Recorder(window=300)
    for worker in range(4):
        rec.invitations.offer(worker, 10 + worker, 0, 100)
    assert rec.sent == [(0, 10, 0), (1, 11, 0), (2, 12, 0)] and rec.invitations.admitted == 300
    rec.invitations.arrived(1, 11, 0)
    assert rec.sent[-1] == (3, 13, 0) and rec.invitations.admitted == 300
    for worker in (0, 2, 3):
        rec.invitations.arrived(worker, 10 + worker, 0)
    assert rec.invitations.admitted == 0 and rec.invitations.peak == 300 and not rec.invitations.invited


def test_a_part_bigger_than_the_window_is_still_invited_alone():
    rec = Recorder(window=50)
    rec.invitations.offer(0, 1, 0, 100)
    rec.invitations.offer(1, 1, 0, 100)
    assert rec.sent == [(0, 1, 0)]
    rec.invitations.arrived(0, 1, 0)
    assert rec.sent == [(0, 1, 0), (1, 1, 0)]


def test_a_push_that_was_not_invited_changes_nothing():
    rec = Recorder(window=100)
    rec.invitations.offer(0, 1, 0, 100)
    rec.invitations.offer(1, 1, 0, 100)
    rec.invitations.arrived(1, 99, 0)  # a push sent without an offer (another part, or a worker of a smaller job)
    assert rec.sent == [(0, 1, 0)] and rec.invitations.admitted == 100


def test_a_rejoined_worker_takes_its_offers_and_admitted_bytes_with_it():
    rec = Recorder(window=100)
    rec.invitations.offer(0, 1, 0, 100)
    rec.invitations.offer(0, 2, 0, 100)
    rec.invitations.offer(1, 1, 0, 100)
    rec.invitations.forget_worker(0)
    assert rec.sent == [(0, 1, 0), (1, 1, 0)] and rec.invitations.invited == {(1, 1, 0): 100}


def test_a_window_of_0_lets_every_offer_in_at_once():
    rec = Recorder(window=0)
    for worker in range(5):
        rec.invitations.offer(worker, 1, 0, 1 << 30)
    assert len(rec.sent) == 5


def run_rounds(job: InProcJob, rounds: int) -> list[np.ndarray]:
    """Every worker pushes ``rank + 1 + round`` and pulls the key back, round after round; the pulls."""
    pulled = []
    for round_ in range(rounds):
        outs = [np.zeros(VALUES, np.float32) for _ in job.workers]

        def step(rank: int, out: np.ndarray, round_=round_) -> None:
            worker = job.workers[rank]
            worker.push([(0, 7, np.full(VALUES, rank + 1 + round_, np.float32))])
            future = worker.pull([(0, 7, out)])
            assert worker.wait_for(future, 10)
            future.result()

        on_threads(*(lambda r=r, o=o: step(r, o) for r, o in enumerate(outs)))
        pulled.append(outs)
    return pulled


@contextlib.contextmanager
def recorded_job(workers: int, window: int):
    """A job of ``workers`` workers and one server holding key 7, every worker's messages recorded."""
    with InProcJob(num_workers=workers, num_servers=1, settings={"PSLAUNCH_PUSH_WINDOW": str(window)}) as job:
        init_keys(job, {7: (0, np.zeros(VALUES, np.float32))})
        for worker in job.workers:
            worker.conn.transport.record = True
        yield job


def test_pushes_whose_copies_would_pass_the_window_go_by_invitation_and_the_rounds_sum_right():
    # 3 workers x 256 KiB = 768 KiB > 512 KiB: every worker offers; at most two pushes are let in at once
    with recorded_job(3, 512 << 10) as job:
        pulled = run_rounds(job, 3)
        for round_, outs in enumerate(pulled):
            for out in outs:  # no updater: a round's sum becomes the value
                assert np.all(out == 6 + 3 * round_), (round_, out[:3])
        invitations = job.servers[0].invitations
        # never more than the window in at once; whether two ever were depends on how the workers'
        # threads interleave (on a loaded machine a push may be in before the next offer comes: the
        # window's arithmetic is the unit tests' above)
        assert 256 << 10 <= invitations.peak <= 512 << 10, invitations.peak
        assert invitations.admitted == 0 and not invitations.queued
        for worker in job.workers:
            pushes = [h for h in sent_headers(worker) if h[0] == Cmd.PUSH]
            offers = [h for h in pushes if h[1] & FLAG_OFFER]
            assert len(offers) == 3 and len(pushes) == 6, pushes  # an offer, then the push, per round


def test_pushes_whose_copies_fit_the_window_are_sent_at_once():
    with recorded_job(2, 512 << 10) as job:
        pulled = run_rounds(job, 2)
        assert np.all(pulled[1][0] == 2 + 3)  # round 1: ranks 0 and 1 push 2 and 3
        for worker in job.workers:
            assert not [h for h in sent_headers(worker) if h[0] == Cmd.PUSH and h[1] & FLAG_OFFER]
        assert job.servers[0].invitations.peak == 0


@pytest.fixture
def offering_job():
    with InProcJob(num_workers=2, num_servers=1, settings={"PSLAUNCH_PUSH_WINDOW": "1024"},
                   network_threads=False) as job:
        init_keys(job, {7: (0, np.zeros(VALUES, np.float32))})
        yield job


def offer(worker, nbytes: int, key: int = 7, codec: int = 0) -> concurrent.futures.Future:
    """A hand-made offer of ``worker``'s push (tracked as a request); the future its refusal completes."""
    future = concurrent.futures.Future()
    req = worker.requests.track(future, 1, None, "push", 0)
    entry = ENTRY_STRUCT.pack(key, 0, 1, codec, 0, nbytes, 1)
    worker.conn.transport.send(worker.servers[0].uid.encode(), [pack_header(Cmd.PUSH, req, 1, FLAG_OFFER), entry])
    return future


@pytest.mark.parametrize("nbytes, key, codec, expected", [
    (1 << 40, 7, 0, "key 7: a push of 1099511627776 bytes, but this server holds 262144"),
    (VALUES * 4, 99, 0, "key id 0x63 was never initialised on this server"),
    (VALUES * 4, 7, 99, "a push encoded with unknown codec 99"),
    (VALUES * 4, 7, 1, "key 7: a 2bit push of 262144 bytes, but the 65536 values held here take 16384 bytes"),
])
def test_an_offer_of_a_wrong_size_key_or_codec_is_refused_naming_it_and_nothing_waits_for_it(offering_job, nbytes,
                                                                                             key, codec, expected):
    worker = offering_job.workers[0]
    future = offer(worker, nbytes, key, codec)
    assert worker.wait_for(future, 10)
    with pytest.raises(RemoteError, match=expected):
        future.result()
    assert offering_job.servers[0].invitations.admitted == 0  # nothing was let in for it
    if key == 7:  # the refused push counts: the worker's pull of its one push is answered, not left waiting
        out = np.zeros(VALUES, np.float32)
        pull = worker.pull([(0, 7, out)])
        assert worker.wait_for(pull, 10) and pull.result() is None


def test_an_invitation_for_nothing_offered_is_counted_as_malformed_and_fails_nothing(offering_job):
    worker = offering_job.workers[0]
    out = np.zeros(VALUES, np.float32)
    pull = worker.pull([(0, 7, out)])
    server = offering_job.servers[0]
    server.conn.transport.send(worker.conn.me.uid.encode(), [pack_header(Cmd.PUSH_INVITE, 4242, 0)])
    assert worker.wait_for(pull, 10) and pull.result() is None
    assert worker.conn.link.malformed >= 1 and not worker.data.offers
