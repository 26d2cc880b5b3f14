"""Collectives between workers on an in-process job: exact sums on every algorithm, order, failure.

Every worker is a real ``WorkerNode`` (its ``collectives`` engine, the real scheduler) on the
``inproc`` transport; shared memory is real too (memfd regions mapped through /proc). A topology
with several hosts is described to the engines, which is how one process tests the hierarchical
path.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from psnode_testkit import InProcJob

from psnode.collectives import Topology, algorithm_names, choose, key_id_of, local, wire
from psnode.collectives import engine as engine_module
from psnode.collectives.base import DIRECT_MAX, SEGMENT, SEGMENT_MAX, ring_segment
from psnode.collectives.fusion import FusionBuffer, plan
from psnode.collectives.local import SUM_BLOCK, SharedRegions, sum_slice
from psnode.collectives.wire import Desc, Kind
from psnode.errors import MismatchError, PeerDiedError, ProtocolError, PSNodeError
from psnode.node.protocol import Cmd, pack_header

HOSTS = {  # workers -> the hosts each algorithm is tested on
    "direct": {2: (0, 1), 3: (0, 1, 2), 4: (0, 1, 2, 3)},
    "ring": {2: (0, 1), 3: (0, 1, 2), 4: (0, 1, 2, 3)},
    "shm": {2: (0, 0), 3: (0, 0, 0), 4: (0, 0, 0, 0)},
    "hierarchical": {4: (0, 0, 1, 1), 6: (0, 0, 0, 1, 1, 1)},
}


def job_of(workers: int, hosts: tuple[int, ...] | None = None, **settings) -> InProcJob:
    """An in-process job without servers; ``hosts`` describes where each worker runs (shared memory on)."""
    job = InProcJob(num_workers=workers, num_servers=0, settings=settings or None,
                    expect_failure="PS_HEARTBEAT_TIMEOUT" in settings)
    job.hosts = hosts
    return job


class Started:
    """An InProcJob whose engines were told the topology."""

    def __init__(self, job: InProcJob) -> None:
        self.job = job

    def __enter__(self) -> list:
        self.job.__enter__()
        if self.job.hosts is not None:
            for w in self.job.workers:
                w.collectives._topology = Topology(w.rank, self.job.hosts, True)
        return self.job.workers

    def __exit__(self, *exc) -> None:
        self.job.__exit__(*exc)


def finish(workers, futures, timeout: float = 10):
    """Wait for every worker's future (each on its own node); their results or errors."""
    outcomes = []
    for worker, future in zip(workers, futures):
        try:
            assert worker.wait_for(future, timeout), f"worker {worker.rank}'s collective did not end in {timeout} s"
            outcomes.append(future.result())
        except PSNodeError as exc:
            outcomes.append(exc)
    return outcomes


def allreduce_all(workers, key, values, **kwargs):
    futures = [w.collectives.allreduce(key, v, **kwargs) for w, v in zip(workers, values)]
    return finish(workers, futures)


CASES = [(name, n) for name, by_n in HOSTS.items() for n in by_n]


@pytest.mark.parametrize("name,workers", CASES, ids=[f"{a}-{n}" for a, n in CASES])
def test_every_algorithm_gives_exact_integer_sums_on_every_worker(name, workers):
    sizes = [1, 7, 1000, 2 * SEGMENT // 8 + 3]  # one element, uneven slices, several segments per chunk
    with Started(job_of(workers, HOSTS[name][workers])) as ws:
        for size in sizes:
            for dtype in (np.int64, np.int32):
                values = [np.arange(size, dtype=dtype) * (w.rank + 1) - w.rank for w in ws]
                assert allreduce_all(ws, ("case", size), values, algorithm_name=name) == [None] * workers
                total = sum(range(1, workers + 1))
                expected = np.arange(size, dtype=dtype) * total - sum(range(workers))
                for value in values:
                    assert np.array_equal(value, expected), (name, size, dtype, value[:4], expected[:4])


def test_a_rings_segments_are_a_quarter_of_its_chunk_between_the_bounds():
    assert ring_segment(1000, 4) == SEGMENT // 4  # small chunks: SEGMENT bytes
    assert ring_segment(3 << 20, 4) == (3 << 20) // 4  # a 12 MiB chunk of float32: four 3 MiB segments
    assert ring_segment(100 << 20, 8) == SEGMENT_MAX // 8  # big chunks: SEGMENT_MAX bytes
    assert ring_segment(1, 8) >= 1


def test_a_big_ring_cuts_its_chunks_into_bigger_segments_and_sums_exactly():
    size = 6 * (1 << 20) + 5  # int32, 2 workers: chunks of about 12 MiB, cut into segments of about 3 MiB
    with Started(job_of(2, HOSTS["ring"][2])) as ws:
        values = [np.arange(size, dtype=np.int32) * (w.rank + 1) - w.rank for w in ws]
        allreduce_all(ws, "big", values, algorithm_name="ring")
        expected = np.arange(size, dtype=np.int32) * 3 - 1
        assert all(np.array_equal(v, expected) for v in values)


@pytest.mark.parametrize("others", [1, 3])
def test_the_same_host_sum_by_blocks_gives_the_bits_of_whole_array_passes(others):
    # the block loop must not change the order of additions per element, miss a tail, or publish stale blocks
    rng = np.random.default_rng(others)
    size = 3 * (SUM_BLOCK // 4) + 17  # float32: three whole blocks and a tail
    mine = rng.standard_normal(size).astype(np.float32)
    theirs = [rng.standard_normal(size).astype(np.float32) * 1e3 for _ in range(others)]
    expected = mine.copy()
    for other in theirs:
        np.add(expected, other, out=expected)
    publish = np.zeros(size, np.float32)
    sum_slice(mine, theirs, publish)
    assert mine.tobytes() == expected.tobytes() and publish.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", ["ring", "shm"])
def test_float_sums_are_the_same_bits_on_every_worker(name):
    hosts = (0, 0, 0) if name == "shm" else (0, 1, 2)
    with Started(job_of(3, hosts)) as ws:
        rng = np.random.default_rng(5)
        values = [rng.standard_normal(50_001).astype(np.float32) for _ in ws]
        expected = values[0].astype(np.float64) + values[1] + values[2]
        allreduce_all(ws, "f", values, algorithm_name=name)
        assert all(np.array_equal(values[0], v) for v in values[1:])
        assert np.allclose(values[0], expected, rtol=1e-5, atol=1e-5)


def test_out_keeps_the_input_and_non_contiguous_values_are_summed_through_a_copy():
    with Started(job_of(2)) as ws:
        values = [np.arange(12, dtype=np.int64).reshape(3, 4) * (w.rank + 1) for w in ws]
        outs = [np.zeros((3, 4), np.int64) for _ in ws]
        finish(ws, [w.collectives.allreduce("out", v, out=o) for w, v, o in zip(ws, values, outs)])
        assert all(np.array_equal(o, np.arange(12).reshape(3, 4) * 3) for o in outs)
        assert np.array_equal(values[1], np.arange(12).reshape(3, 4) * 2)  # the input is untouched
        columns = [np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2] * (w.rank + 1) for w in ws]
        finish(ws, [w.collectives.allreduce("cols", c) for w, c in zip(ws, columns)])
        assert all(np.array_equal(c, np.arange(24).reshape(4, 6)[:, ::2] * 3) for c in columns)


def test_workers_that_start_collectives_in_different_orders_still_meet_by_key_and_version():
    with Started(job_of(3, (0, 1, 2))) as ws:
        big = 3 * DIRECT_MAX  # ring sized: several messages each
        order = {0: ["a", "b", "c"], 1: ["c", "a", "b"], 2: ["b", "c", "a"]}
        values = {(w.rank, k): np.full(big // 8 if k != "c" else 3, w.rank + 1, np.int64) for w in ws for k in "abc"}
        futures = {(w.rank, k): w.collectives.allreduce(k, values[(w.rank, k)]) for w in ws for k in order[w.rank]}
        for (rank, key), future in futures.items():
            assert ws[rank].wait_for(future, 10)
            future.result()
            assert np.all(values[(rank, key)] == 6), (rank, key)


def test_a_collective_started_late_finds_what_came_early_and_versions_of_one_key_stay_in_order():
    with Started(job_of(2, (0, 1))) as ws:
        early = [ws[0].collectives.allreduce("k", np.full(5, 10 * v, np.int64)) for v in range(3)]
        # worker 0's first one waits on worker 1; the next two wait for it (one key: in order)
        arrived = lambda: sum(len(m) for m in ws[1].collectives.early.values())  # noqa: E731
        deadline = time.monotonic() + 10
        while arrived() < 1:
            assert time.monotonic() < deadline, "worker 0's first message never reached worker 1"
            time.sleep(0.01)
        # Had the next two been sent, they would have left in the same calls as the first, on the
        # same connection, right behind it: 0.2 s of watching after the first arrived is ample.
        time.sleep(0.2)
        assert arrived() == 1
        late = [ws[1].collectives.allreduce("k", np.full(5, v, np.int64)) for v in range(3)]
        for f0, f1 in zip(early, late):
            finish(ws, [f0, f1])
        assert not ws[1].collectives.early and ws[1].collectives.early_bytes == 0


def test_workers_that_pass_different_shapes_all_raise_a_mismatch_naming_both():
    with Started(job_of(3, (0, 1, 2))) as ws:
        values = [np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(5, np.float32)]
        errors = allreduce_all(ws, "w", values)
        assert all(isinstance(e, MismatchError) for e in errors), errors
        for e in errors:  # each names the key and both values, as the worker that saw it could
            text = str(e)
            assert "key 'w'" in text and ("5 elements" in text or "(5,)" in text), text
            assert "4 elements" in text or "(4,)" in text, text
        # the job goes on: the next collective of the key works
        assert allreduce_all(ws, "w", [np.ones(4, np.float32) for _ in ws]) == [None] * 3


def test_workers_that_pass_different_dtypes_all_raise_a_mismatch_naming_both():
    with Started(job_of(2, (0, 1))) as ws:
        errors = allreduce_all(ws, "d", [np.zeros(3, np.float32), np.zeros(3, np.float64)])
        assert all(isinstance(e, MismatchError) and "float64" in str(e) and "float32" in str(e) for e in errors), errors


def test_a_dead_worker_fails_every_other_workers_collective_naming_it():
    with Started(job_of(3, (0, 1, 2), PS_HEARTBEAT_INTERVAL="0.1", PS_HEARTBEAT_TIMEOUT="0.8")) as ws:
        dead = ws[2]
        dead.receiver.stop()
        dead.conn.transport.close()  # as a killed process: no goodbye, no more heartbeats
        dead.closed = True
        # within finish's deadline of 10 s, 12 times the heartbeat timeout
        errors = finish(ws[:2], [w.collectives.allreduce("x", np.ones(300_000, np.float32)) for w in ws[:2]])
        assert all(isinstance(e, PeerDiedError) and e.rank == 2 and "worker 2" in str(e) for e in errors), errors
        with pytest.raises(PeerDiedError):  # and every later one, at once
            ws[0].collectives.allreduce("y", np.ones(3, np.float32))


def test_a_worker_that_finished_the_job_fails_the_collectives_waiting_for_it():
    with Started(job_of(2, (0, 1))) as ws:
        waiting = ws[0].collectives.allreduce("z", np.ones(3, np.float32))
        ws[1].close(timeout=5)
        assert ws[0].wait_for(waiting, 10)
        error = waiting.exception()
        assert isinstance(error, PeerDiedError) and "finished the job" in str(error) and error.rank == 1, error


def _send_raw(sender, receiver_rank: int, frames: list) -> None:
    sender.collectives.send(receiver_rank, frames, False)


def test_a_malformed_message_for_a_running_collective_fails_it_on_both_workers_instead_of_waiting():
    with Started(job_of(2, (0, 1))) as ws:
        told = threading.Event()  # worker 0 keeps worker 1's word on a collective it has not started
        keep_early = ws[0].collectives._keep_early

        def keeping(*args):
            keep_early(*args)
            if ws[0].collectives.told:
                told.set()

        ws[0].collectives._keep_early = keeping
        future = ws[1].collectives.allreduce("m", np.ones(4, np.float32))
        key_id = key_id_of(("m"))
        desc = Desc(np.float32, (4,))
        frames = wire.pack(key_id, 0, Kind.DIRECT, desc, count=4) + [b"\x00" * 12]  # 3 elements' bytes for 4
        _send_raw(ws[0], 1, frames)
        assert ws[1].wait_for(future, 10)
        error = future.exception()
        assert isinstance(error, ProtocolError) and "worker 0" in str(error) and "data bytes" in str(error), error
        # worker 0 is told (a message from worker 1, which it reads on its own thread): its own
        # collective of that key and version then fails at once too
        assert told.wait(10), "worker 0 was never told that worker 1's collective failed"
        mine = ws[0].collectives.allreduce("m", np.ones(4, np.float32))
        assert ws[0].wait_for(mine, 10) and isinstance(mine.exception(), ProtocolError)


@pytest.mark.parametrize("frames,why", [
    (lambda k: [pack_header(Cmd.COLL, k, 0), b"short"], "record of 5 bytes"),
    (lambda k: [pack_header(Cmd.COLL, k, 0), wire.RECORD.pack(99, 2, 0, 0, 0, 0, 4, 0, 4, 0), b"x" * 16], "unknown kind 99"),
    (lambda k: [pack_header(Cmd.COLL, k, 0), wire.RECORD.pack(1, 42, 0, 0, 0, 0, 4, 0, 4, 0), b"x" * 16], "dtype code 42"),
    (lambda k: [pack_header(Cmd.COLL, k, 0), wire.RECORD.pack(1, 2, 0, 0, 0, 0, 4, 3, 4, 0), b"x" * 16], "of a collective of 4"),
])
def test_malformed_messages_for_no_collective_are_counted_and_dropped_and_the_next_collective_works(frames, why):
    with Started(job_of(2, (0, 1))) as ws:
        _send_raw(ws[0], 1, frames(key_id_of("nothing")))
        deadline = time.monotonic() + 5
        while ws[1].collectives.malformed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ws[1].collectives.malformed == 1 and why in ws[1].collectives.malformed_reason
        assert allreduce_all(ws, "after", [np.ones(3, np.int32) for _ in ws]) == [None, None]


def test_a_segment_sent_twice_fails_the_ring_instead_of_counting_twice():
    with Started(job_of(2, (0, 1))) as ws:
        n = 2 * DIRECT_MAX // 4  # two chunks of one segment each
        future = ws[1].collectives.allreduce("dup", np.ones(n, np.int32), algorithm_name="ring")
        desc = Desc(np.int32, (n,))
        half = n // 2  # worker 1 first receives chunk 0 from its left neighbour, worker 0
        segment = wire.pack(key_id_of("dup"), 0, Kind.RING_RS, desc, 0, 0, 0, half) + [np.ones(half, np.int32).tobytes()]
        _send_raw(ws[0], 1, segment)
        _send_raw(ws[0], 1, segment)
        assert ws[1].wait_for(future, 10)
        assert isinstance(future.exception(), ProtocolError) and "twice" in str(future.exception())


def test_too_much_for_collectives_not_started_fails_the_worker_with_a_sentence(monkeypatch):
    monkeypatch.setattr(engine_module, "EARLY_MESSAGES", 5)
    job = job_of(2, (0, 1))
    job.expect_failure = True  # worker 1 fails on purpose
    with Started(job) as ws:
        for v in range(8):
            ws[0].collectives.allreduce(("flood", v), np.ones(2, np.float32))
        deadline = time.monotonic() + 5
        while ws[1].failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ws[1].failure is not None and "has not started" in str(ws[1].failure)
        ws[0].receiver.stop()  # the job cannot end in order: leave without waiting for the scheduler
        ws[0].conn.transport.close()
        ws[0].closed = True


def test_broadcast_copies_the_roots_value_and_allgather_stacks_every_workers():
    with Started(job_of(3, (0, 1, 2))) as ws:
        values = [np.full(300_001, w.rank, np.int64) for w in ws]
        finish(ws, [w.collectives.broadcast("b", v, root=1) for w, v in zip(ws, values)])
        assert all(np.all(v == 1) for v in values)
        outs = [np.zeros((3, 2), np.int32) for _ in ws]
        finish(ws, [w.collectives.allgather("g", np.array([w.rank, -w.rank], np.int32), o) for w, o in zip(ws, outs)])
        assert all(o.tolist() == [[0, 0], [1, -1], [2, -2]] for o in outs)


def test_a_broadcast_from_a_root_a_worker_does_not_expect_fails_it_on_every_worker_naming_both():
    with Started(job_of(3, (0, 1, 2))) as ws:
        roots = [0, 0, 1]  # worker 2 expects worker 1's value; worker 0 sends its own
        errors = finish(ws, [w.collectives.broadcast("r", np.zeros(3), root=r) for w, r in zip(ws, roots)])
        assert all(isinstance(e, ProtocolError) for e in errors), errors
        assert all("worker 0 sent a broadcast" in str(e) and "expects from worker 1" in str(e) for e in errors), errors


def test_a_peer_region_that_is_not_a_region_of_this_job_from_that_peer_is_refused(tmp_path):
    import os

    from psnode.node.membership import PeerInfo

    def workers_with(pid):
        return [PeerInfo("worker", r, "127.0.0.1", 1, f"w{r}", "f", "l", 0, pid) for r in range(2)]

    regions = SharedRegions(workers_with(os.getpid()), "job")
    plain = tmp_path / "file"
    plain.write_bytes(b"x" * 64)
    fd = os.open(plain, os.O_RDONLY)  # a descriptor of this process that is no region
    try:
        with pytest.raises(ProtocolError, match="not a shared-memory region of this job"):
            regions.view(1, (os.getpid() << 32) | fd, 8)
    finally:
        os.close(fd)
    with pytest.raises(ProtocolError, match="but its sender is process 1"):  # another process than the peer's
        SharedRegions(workers_with(1), "job").view(1, (os.getpid() << 32) | 3, 8)
    with pytest.raises(ProtocolError, match="cannot be mapped"):
        regions.view(1, (os.getpid() << 32) | 999_999, 8)
    import signal
    import subprocess

    dead = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead_ref = (dead.pid << 32) | 3
        deadline = time.monotonic() + 5
        while not open(f"/proc/{dead.pid}/stat").read().rsplit(")", 1)[-1].split()[0] == "Z":
            assert time.monotonic() < deadline, "the killed process did not become a zombie"
            time.sleep(0.01)
        with pytest.raises(PeerDiedError, match=f"worker 1 \\(pid {dead.pid}\\) died"):  # killed, not reaped yet
            SharedRegions(workers_with(dead.pid), "job").view(1, dead_ref, 8)
    finally:
        dead.wait()
    mine = regions.take(16)
    too_big = mine.nbytes + 64  # past the value and the receipt after it: a size the region does not have
    with pytest.raises(ProtocolError, match=f"bytes, not {too_big}"):
        regions.view(1, mine.ref, too_big)
    assert regions.view(1, mine.ref, 8).nbytes == 8


def test_choose_picks_direct_for_small_values_and_by_topology_for_big_ones():
    assert choose(64, Topology(0, (0, 1), True)) == "direct"
    big = 4 << 20
    assert choose(big, Topology(0, (0, 0, 0), True)) == "shm"
    assert choose(big, Topology(0, (0, 0, 1, 1), True)) == "hierarchical"
    assert choose(big, Topology(0, (0, 1, 2), True)) == "ring"
    assert choose(big, Topology(0, (0, 0, 1), True)) == "ring"  # hosts of unequal size
    assert choose(big, Topology(0, (0, 0), False)) == "ring"  # shared memory off (PSLAUNCH_SAME_HOST)
    assert set(algorithm_names()) >= {"direct", "ring", "shm", "hierarchical"}


def test_fusion_groups_consecutive_values_of_one_dtype_up_to_the_limit():
    nbytes = [4, 4, 4, 100, 4, 4]
    dtypes = ["f4", "f4", "i4", "f4", "f4", "f4"]
    assert plan(nbytes, dtypes, 50) == [[0, 1], [2], [3], [4, 5]]
    assert plan(nbytes, dtypes, 0) == [[i] for i in range(6)]
    fused = FusionBuffer(np.float32, [2, 3])
    fused.pack([np.array([1, 2], np.float32), np.arange(3, dtype=np.float32).reshape(3, 1)])
    outs = [np.zeros(2, np.float32), np.zeros((3, 1), np.float32)]
    fused.unpack(outs)
    assert outs[0].tolist() == [1, 2] and outs[1].ravel().tolist() == [0, 1, 2]


def test_key_ids_are_stable_and_distinguish_types():
    assert key_id_of("w") == key_id_of("w") and key_id_of("1") != key_id_of(1)
    assert key_id_of(("kv", ("a", "b"))) != key_id_of(("kv", ("ab",)))
    with pytest.raises(TypeError):
        key_id_of(1.5)


def test_unsupported_dtypes_are_refused_on_the_calling_thread_naming_them():
    with Started(job_of(2, (0, 1))) as ws:
        with pytest.raises(TypeError, match="complex128"):
            ws[0].collectives.allreduce("c", np.zeros(2, np.complex128))


# ---- shared arrays: the caller's array in shared memory, summed where it lies ------------------------

def _shared(worker, values: np.ndarray) -> np.ndarray:
    """``values`` copied into a new shared array of ``worker`` (what ``Collectives.shared_empty`` makes)."""
    worker.collectives.shared.shared_array(64)  # the array is not at its region's start: an offset travels
    region, offset = worker.collectives.shared.shared_array(values.nbytes)
    assert offset > 0
    array = region.array[offset:offset + values.nbytes].view(values.dtype)
    array[:] = values
    return array


@pytest.mark.parametrize("name,workers,mixed", [("shm", 2, False), ("shm", 3, True), ("shm", 4, False),
                                                ("hierarchical", 4, True), ("hierarchical", 6, False)])
def test_shared_arrays_are_summed_in_place_exactly_with_no_region_of_the_op_taken(name, workers, mixed):
    sizes = [1000, 2 * SEGMENT // 8 + 3]
    with Started(job_of(workers, HOSTS[name][workers])) as ws:
        for size in sizes:
            plain = [np.arange(size, dtype=np.int64) * (w.rank + 1) - w.rank for w in ws]
            # mixed: the odd ranks keep private arrays, the others shared ones; each side handles the other
            values = [p if mixed and w.rank % 2 else _shared(w, p) for w, p in zip(ws, plain)]
            assert allreduce_all(ws, ("shared", size), values, algorithm_name=name) == [None] * workers
            expected = np.arange(size, dtype=np.int64) * sum(range(1, workers + 1)) - sum(range(workers))
            for w, value in zip(ws, values):
                assert np.array_equal(value, expected), (name, size, w.rank, value[:4], expected[:4])
        for w in ws:  # a worker with a shared array copied nothing into a region of the op
            assert (w.collectives.shared._free == []) == (not mixed or w.rank % 2 == 0), (w.rank, w.collectives.shared._free)


def test_a_shared_array_is_not_given_back_before_the_other_workers_read_it(monkeypatch):
    # Worker 1 reads worker 0's slice late; worker 0's allreduce must not complete before that,
    # or a caller that reuses its array at once would hand worker 1 its next values.
    entered, release = threading.Event(), threading.Event()
    original = local.LocalPhase._check_done

    def slow_copy_out(phase):
        if phase.op.engine.rank == 1 and phase.stage == "done" and len(phase.done_from) == len(phase.peers):
            entered.set()
            release.wait(10)
        original(phase)

    monkeypatch.setattr(local.LocalPhase, "_check_done", slow_copy_out)
    with Started(job_of(2, (0, 0))) as ws:
        size = 2 * SEGMENT // 8 + 3
        values = [_shared(ws[0], np.full(size, 1, np.int64)), np.full(size, 2, np.int64)]
        futures = [w.collectives.allreduce("late", v, algorithm_name="shm") for w, v in zip(ws, values)]
        assert entered.wait(10), "worker 1 never reached its copy out"
        # Worker 0 completes within milliseconds of hearing worker 1 is done (the test above); 0.2 s
        # of watching while worker 1 is held shows it waits for that instead.
        time.sleep(0.2)
        assert not futures[0].done(), "worker 0's allreduce completed while worker 1 still had to read its array"
        release.set()
        assert finish(ws, futures) == [None, None]
        assert np.all(values[0] == 3) and np.all(values[1] == 3)


@pytest.mark.parametrize("offset,why", [(1 << 40, "bytes, not"), (local.ARENA - 8, "bytes, not"),
                                        (3, "not a multiple of the 8-byte elements")])
def test_a_shared_array_named_past_its_region_or_off_its_elements_is_refused_naming_the_worker(offset, why):
    with Started(job_of(2, (0, 0))) as ws:
        size = 2 * SEGMENT // 8 + 3
        region, _ = ws[0].collectives.shared.shared_array(size * 8)
        desc = Desc(np.int64, (size,))
        future = ws[1].collectives.allreduce("far", np.ones(size, np.int64), algorithm_name="shm")
        frames = wire.pack(key_id_of("far"), 0, Kind.SHM_READY, desc, offset & 0xFFFFFFFF, offset >> 32, aux=region.ref)
        _send_raw(ws[0], 1, frames)
        assert ws[1].wait_for(future, 10)
        error = future.exception()
        assert isinstance(error, ProtocolError) and "worker 0" in str(error) and why in str(error), error


def test_shared_arrays_are_cut_from_arenas_apart_and_aligned_and_a_big_one_gets_a_region_of_its_own():
    regions = SharedRegions([], "job")
    before = len(os.listdir("/proc/self/fd"))
    spans = []
    for nbytes in [1, 100, 4096, 1 << 20] * 50:  # 200 arrays: about 50 MiB, one arena
        region, offset = regions.shared_array(nbytes)
        assert offset % local.SHARED_ALIGN == 0 and offset + nbytes <= region.nbytes
        spans.append((region.array.ctypes.data + offset, nbytes))
    spans.sort()
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), "two shared arrays overlap"
    assert len(os.listdir("/proc/self/fd")) - before <= 2, "a descriptor per shared array"  # the memfd, mmap's copy
    big, offset = regions.shared_array(local.ARENA + 1)
    assert offset == 0 and big.nbytes >= local.ARENA + 1
    inside = big.array[:local.ARENA + 1].view(np.uint8)[8:16]
    assert regions.locate(inside) == (big, 8)
    assert regions.locate(np.zeros(8, np.uint8)) is None


def test_an_error_names_a_fused_keys_group_by_its_first_keys_and_count_not_all_of_them():
    from psnode.collectives.tags import Label

    text = str(Label("allreduce", ("kv", tuple(f"k{i}" for i in range(1000)), 979, 1000)))
    assert text == "allreduce of key ('kv', ('k0', 'k1', 'k2', 'k3', 'k4', ... 1000 in all), 979, 1000)", text
    assert str(Label("allreduce", ("w",))) == "allreduce of key ('w',)"
    assert len(str(Label("broadcast", "x" * 5000))) < 400


def test_a_ring_names_the_place_of_an_allgather_segment_it_expects_and_of_nothing_else():
    # what a lane reads straight into the value (lane_path): only a segment the ring expects next
    with Started(job_of(2, (0, 1))) as ws:
        n = 2 * DIRECT_MAX // 4  # two chunks of one segment each
        half = n // 2
        value = np.ones(n, np.int32)
        engine = ws[1].collectives
        future = engine.allreduce("place", value, algorithm_name="ring")
        desc, tag = Desc(np.int32, (n,)), (key_id_of("place"), 0)

        def record(kind, offset, src_step=0, segment=0, count=half):
            return wire.Record(kind, desc.code, 0, desc.crc, src_step, segment, n, offset, count, 0)

        place = engine.destination(0, tag, record(Kind.RING_AG, half))  # worker 1 gathers chunk 1 first
        assert place is not None and np.shares_memory(place, value) and place.ctypes.data == value[half:].ctypes.data
        assert engine.destination(0, tag, record(Kind.RING_RS, 0)) is None  # summed: it lands in a buffer
        assert engine.destination(0, tag, record(Kind.RING_AG, 0)) is None  # another chunk's elements
        assert engine.destination(0, tag, record(Kind.RING_AG, half, segment=1)) is None  # no such segment
        assert engine.destination(1, tag, record(Kind.RING_AG, half)) is None  # not its left neighbour
        assert engine.destination(0, (tag[0], 1), record(Kind.RING_AG, half)) is None  # not started
        mine = ws[0].collectives.allreduce("place", np.ones(n, np.int32), algorithm_name="ring")
        assert finish(ws, [mine, future]) == [None, None] and np.all(value == 2)
        assert engine.destination(0, tag, record(Kind.RING_AG, half)) is None  # done
