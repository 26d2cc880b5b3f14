"""Checkpoint requests on the servers: files written whole, the manifest last, restores that re-shard,
and every malformed request refused naming what was wrong. In-process, on the inproc transport."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import numpy as np
import pytest
from psnode_testkit import InProcJob, init_keys

from psnode.checkpoint import file_format as cf
from psnode.checkpoint import layout as ck
from psnode.errors import PeerDiedError, PSNodeError, RemoteError
from psnode.scheduler.node import Roster

pytestmark = pytest.mark.unit


class MomentumUpdater:
    """An updater with element-wise state that speaks the checkpoint protocol (as kvcore's does)."""

    def __init__(self) -> None:
        self.mom: dict = {}
        self.updates: dict = {}

    def __call__(self, key, merged, stored):
        mom = self.mom.setdefault(key, np.zeros_like(stored))
        mom *= np.float32(0.5)
        mom += merged
        stored += mom
        self.updates[key] = self.updates.get(key, 0) + 1

    def state_dict(self):
        return {"scalars": {"kind": "momentum"},
                "keys": {k: {"scalars": {"updates": self.updates.get(k, 0)}, "arrays": [m]} for k, m in self.mom.items()}}

    def load_state_dict(self, state):
        for key, item in state["keys"].items():
            self.mom[key] = item["arrays"][0]
            self.updates[key] = item["scalars"]["updates"]


def ask(worker, bodies: dict) -> dict:
    future, replies = worker.checkpoint(bodies)
    assert worker.wait_for(future, 10), "no reply"
    future.result()
    return dict(replies)


def refused(worker, bodies: dict) -> str:
    future, _ = worker.checkpoint(bodies)
    assert worker.wait_for(future, 10), "no reply"
    with pytest.raises(RemoteError) as caught:
        future.result()
    return str(caught.value)


def idle(node, timeout: float = 10.0) -> None:
    """Wait until ``node``'s checkpoint work on its background thread is done and answered."""
    deadline = time.monotonic() + timeout
    while node.checkpoints.busy:
        assert time.monotonic() < deadline, "the background work of the checkpoint did not end"
        time.sleep(0.01)


def step(job, key: int, server: int, values) -> None:
    """One dist_sync round of ``key``: worker i pushes ``values[i]``, then both pull."""
    out = np.zeros_like(values[0])
    futures = [w.push([(server, key, v)]) for w, v in zip(job.workers, values)]
    futures += [w.pull([(server, key, out)]) for w in job.workers]
    for future, worker in zip(futures, job.workers * 2):
        assert worker.wait_for(future, 10)
        future.result()


def server(job, rank: int):
    """The server of ``rank`` (``job.servers`` was sorted when the ranks may not all have been known)."""
    return next(s for s in job.servers if s.rank == rank)


def value(job, rank: int, key: int) -> np.ndarray:
    return np.array(server(job, rank).store.shards[key].stored)


def manifest(ckpt_id: int, files: dict, keys: list, num_servers: int = 2) -> dict:
    return {"format": 1, "id": ckpt_id, "num_servers": num_servers, "scalars": {"step": ckpt_id},
            "files": [{"server": s, "name": files[s]["name"], "bytes": files[s]["bytes"]} for s in range(num_servers)],
            "keys": keys}


KEYS = [{"key": 7, "shape": [4], "dtype": "<f4", "parts": [[0, 7, 0, 4]]},
        {"key": 8, "shape": [6], "dtype": "<f4", "parts": [[1, 8, 0, 6]]}]


def commit(job, ckpt_id: int) -> None:
    w0 = job.workers[0]
    files = ask(w0, {s: {"op": "save", "id": ckpt_id} for s in range(2)})
    ask(w0, {0: {"op": "commit", "id": ckpt_id, "manifest": manifest(ckpt_id, files, KEYS)}})


@contextlib.contextmanager
def checkpointing_job(root, network_threads: bool = False):
    """2 workers, 2 servers, keys 7 (server 0) and 8 (server 1), the momentum updater; checkpoints in ``root``."""
    settings = {"PSLAUNCH_CHECKPOINT_DIR": str(root)}
    with InProcJob(num_workers=2, num_servers=2, settings=settings, network_threads=network_threads) as job:
        init_keys(job, {7: (0, np.zeros(4, np.float32)), 8: (1, np.zeros(6, np.float32))})
        ask_updater = job.workers[0].set_updater(MomentumUpdater())
        assert job.workers[0].wait_for(ask_updater, 10)
        ask_updater.result()
        job.root = root
        yield job


@pytest.fixture
def job(tmp_path):
    with checkpointing_job(tmp_path) as job:
        yield job


def test_servers_write_their_files_server_0_the_manifest_and_a_restore_brings_values_and_state_back(job):
    w0 = job.workers[0]
    step(job, 7, 0, [np.ones(4, np.float32), np.full(4, 2, np.float32)])
    step(job, 8, 1, [np.arange(6, dtype=np.float32)] * 2)
    saved = {7: value(job, 0, 7), 8: value(job, 1, 8)}
    commit(job, 3)
    assert sorted(os.listdir(job.root / "ckpt-00000003")) == ["MANIFEST.json", "server-0-of-2.bin", "server-1-of-2.bin"]
    assert ask(w0, {0: {"op": "scan"}})[0] == {"newest": 3, "highest": 3}
    step(job, 7, 0, [np.ones(4, np.float32)] * 2)  # the model moves on ...
    step(job, 8, 1, [np.ones(6, np.float32)] * 2)
    ask(w0, {0: {"op": "restore", "id": 3, "parts": [[7, 7, 0, 4]]}, 1: {"op": "restore", "id": 3, "parts": [[8, 8, 0, 6]]}})
    assert value(job, 0, 7).tobytes() == saved[7].tobytes() and value(job, 1, 8).tobytes() == saved[8].tobytes()
    updater = server(job, 0).store.updater
    assert updater.updates == {7: 1} and updater.mom[7].tolist() == [3.0] * 4  # ... and back, momentum too
    step(job, 7, 0, [np.ones(4, np.float32)] * 2)
    assert value(job, 0, 7).tolist() == [3 + 1.5 + 2] * 4


def test_a_restore_onto_other_servers_re_shards_values_and_element_wise_state(job):
    w0 = job.workers[0]
    step(job, 7, 0, [np.arange(4, dtype=np.float32)] * 2)
    step(job, 8, 1, [np.arange(6, dtype=np.float32)] * 2)
    commit(job, 1)
    # key 8 now held in two parts, one per server: elements 0:2 on server 0, 2:6 on server 1
    ask(w0, {0: {"op": "restore", "id": 1, "parts": [[7, 7, 0, 4], [81, 8, 0, 2]]},
             1: {"op": "restore", "id": 1, "parts": [[82, 8, 2, 6]]}})
    stores = [server(job, r).store for r in range(2)]
    assert stores[0].pending[81][1].tolist() == [0.0, 2.0] and stores[1].pending[82][1].tolist() == [4, 6, 8, 10]
    assert stores[1].updater.mom[8].tolist() == [4, 6, 8, 10]  # the state cut like the values
    assert stores[0].updater.mom[8].tolist() == [0, 2]


def test_a_key_initialised_after_the_restore_keeps_the_checkpoints_value_and_must_fit_it(job):
    w0 = job.workers[0]
    step(job, 8, 1, [np.ones(6, np.float32)] * 2)
    commit(job, 1)
    ask(w0, {1: {"op": "restore", "id": 1, "parts": [[9, 8, 0, 6]]}})  # as key id 9, not initialised yet
    future = w0.init([(1, 9, 8, np.zeros(6, np.float32), 1)], True)
    assert w0.wait_for(future, 10) and future.result() is None
    assert value(job, 1, 9).tolist() == [2.0] * 6
    ask(w0, {1: {"op": "restore", "id": 1, "parts": [[10, 8, 0, 6]]}})
    future = w0.init([(1, 10, 8, np.zeros(5, np.float32), 1)], True)
    assert w0.wait_for(future, 10)
    with pytest.raises(RemoteError, match=r"key 8 is initialised with 5 values of float32 \(shape \(5,\)\), but the "
                                          r"checkpoint restored 6 values of float32 of key 8 for it"):
        future.result()


def gate(node) -> threading.Event:
    """Hold ``node``'s background thread until the event is set: its syncs wait behind it."""
    opened = threading.Event()
    node.checkpoints.background.submit(lambda: opened.wait(20))
    return opened


def test_a_commit_is_answered_only_once_every_servers_file_is_synced_and_the_manifest_is_in(job):
    w0 = job.workers[0]
    commit(job, 1)
    held = gate(server(job, 1))  # server 1 writes its file but cannot sync and rename it yet
    files = ask(w0, {s: {"op": "save", "id": 2} for s in range(2)})
    directory = job.root / "ckpt-00000002"
    future, _ = w0.checkpoint({0: {"op": "commit", "id": 2, "manifest": manifest(2, files, KEYS)}})
    # An answer that did not wait for server 1 would come as soon as server 0 synced its small file,
    # in milliseconds (the commit of checkpoint 1 above): 0.3 s of watching is ample.
    time.sleep(0.3)
    assert not future.done(), "the commit was answered before server 1's file was synced"
    assert not (directory / "server-1-of-2.bin").exists()  # only its temporary file
    assert [p.name.split(".tmp-")[0] for p in directory.glob(".server-1-of-2.bin.tmp-*")] == [".server-1-of-2.bin"]
    assert not (directory / ck.MANIFEST).exists()
    assert ask(w0, {1: {"op": "scan"}})[1]["newest"] == 1  # a restore now would take checkpoint 1
    held.set()
    assert w0.wait_for(future, 10), "no answer to the commit once the files were synced"
    future.result()
    assert sorted(p.name for p in directory.iterdir()) == [ck.MANIFEST, "server-0-of-2.bin", "server-1-of-2.bin"]
    assert ask(w0, {1: {"op": "scan"}})[1]["newest"] == 2


def test_a_file_that_cannot_be_synced_fails_the_commit_naming_the_server_and_why(job):
    w0 = job.workers[0]
    commit(job, 1)
    held = gate(server(job, 1))
    files = ask(w0, {s: {"op": "save", "id": 2} for s in range(2)})
    directory = job.root / "ckpt-00000002"
    (directory / "server-1-of-2.bin").mkdir()  # its final name taken by a directory: the rename fails
    (directory / "server-1-of-2.bin" / "x").write_text("x")
    future, _ = w0.checkpoint({0: {"op": "commit", "id": 2, "manifest": manifest(2, files, KEYS)}})
    held.set()
    assert w0.wait_for(future, 10), "no answer to a commit whose file could not be synced"
    with pytest.raises(RemoteError) as caught:
        future.result()
    assert re.search(r"checkpoint 2 is not complete: server 1: cannot sync the checkpoint file \S+"
                     r"ckpt-00000002/server-1-of-2\.bin to disk: (Is a directory|Directory not empty)", str(caught.value))
    assert not (directory / ck.MANIFEST).exists() and not list(directory.glob(".server-1*"))
    assert ask(w0, {1: {"op": "scan"}})[1]["newest"] == 1
    commit(job, 3)  # the next commit goes on


def test_a_workers_close_waits_for_the_answer_to_a_commit_past_its_time_limit(tmp_path):
    with checkpointing_job(tmp_path, network_threads=True) as job:  # receiving threads, as in a worker process
        _close_while_a_commit_completes(job)


def _close_while_a_commit_completes(job) -> None:
    w0 = job.workers[0]
    held = gate(server(job, 1))
    files = ask(w0, {s: {"op": "save", "id": 1} for s in range(2)})
    future, _ = w0.checkpoint({0: {"op": "commit", "id": 1, "manifest": manifest(1, files, KEYS)}})
    threading.Timer(1.0, held.set).start()
    closing = threading.Thread(target=job.workers[1].close)
    closing.start()
    start = time.monotonic()
    w0.close(timeout=0.2)  # a limit for other requests; the commit's answer is waited for while server 0 lives
    assert time.monotonic() - start > 0.7 and future.done()
    future.result()
    closing.join(10)
    assert (job.root / "ckpt-00000001" / ck.MANIFEST).exists()


def test_a_checkpoint_without_its_manifest_is_ignored_and_removed_by_a_later_commit(job):
    w0 = job.workers[0]
    commit(job, 1)
    ask(w0, {s: {"op": "save", "id": 2} for s in range(2)})  # torn: no manifest
    assert ask(w0, {1: {"op": "scan"}})[1] == {"newest": 1, "highest": 2}
    assert "cannot read the checkpoint manifest" in refused(w0, {0: {"op": "restore", "id": 2, "parts": []}})
    commit(job, 3)
    commit(job, 4)
    idle(server(job, 0))  # old ones are removed on the background thread, after the commit
    assert sorted(os.listdir(job.root)) == ["ckpt-00000003", "ckpt-00000004"]


def test_save_is_refused_while_a_round_is_open_naming_the_key_and_who_pushed(job):
    w0 = job.workers[0]
    future = w0.push([(0, 7, np.ones(4, np.float32))])
    assert w0.wait_for(future, 10)
    message = refused(w0, {0: {"op": "save", "id": 1}})
    assert "key 7 has pushes of workers [0] in a round that is still open on server 0" in message


@pytest.mark.parametrize("body, expected", [
    ({"op": "delete"}, "op one of save, commit, scan, read, restore"),
    ({"op": "save", "id": "../../etc"}, "checkpoint id '../../etc' is not an integer"),
    ({"op": "save", "id": -1}, "checkpoint id -1 is not an integer"),
    ({"op": "read", "id": True}, "checkpoint id True is not an integer"),
    ({"op": "restore", "id": 1, "parts": {}}, "parts are a dict, not a list"),
    ({"op": "restore", "id": 1, "parts": [[7, 99, 0, 4]]}, "key 99 is not in checkpoint 1"),
    ({"op": "restore", "id": 1, "parts": [[7, 7, 3, 9]]}, "restore part [7, 7, 3, 9] of key 7 (of 4 elements"),
    ({"op": "restore", "id": 1, "parts": [[7, [1], 0, 4]]}, "neither a 64-bit int nor a str"),
    ({"op": "commit", "id": 1, "manifest": {"format": 1}}, "a malformed checkpoint manifest"),
])
def test_a_malformed_checkpoint_request_is_refused_naming_what_was_wrong(job, body, expected):
    w0 = job.workers[0]
    commit(job, 1)
    assert expected in refused(w0, {0: body})
    assert ask(w0, {0: {"op": "scan"}})[0]["newest"] == 1  # and the server goes on


def test_a_manifest_naming_a_file_outside_its_checkpoint_is_refused(job):
    w0 = job.workers[0]
    files = ask(w0, {s: {"op": "save", "id": 1} for s in range(2)})
    bad = manifest(1, files, KEYS)
    bad["files"][1]["name"] = "../../x.bin"
    assert "file entry" in refused(w0, {0: {"op": "commit", "id": 1, "manifest": bad}})
    assert not (job.root / "ckpt-00000001" / "MANIFEST.json").exists()


def test_only_worker_0_changes_checkpoints_and_only_server_0_writes_the_manifest(job):
    w0, w1 = job.workers
    assert "worker 1 may not save a checkpoint" in refused(w1, {0: {"op": "save", "id": 1}})
    files = ask(w0, {s: {"op": "save", "id": 1} for s in range(2)})
    assert "server 1 was asked to commit a manifest" in refused(w0, {1: {"op": "commit", "id": 1,
                                                                          "manifest": manifest(1, files, KEYS)}})
    assert ask(w1, {0: {"op": "scan"}})[0] == {"newest": None, "highest": 1}  # reading is everyone's


def test_a_truncated_or_corrupted_file_is_refused_at_restore_and_nothing_changes(job):
    w0 = job.workers[0]
    step(job, 7, 0, [np.ones(4, np.float32)] * 2)
    commit(job, 1)
    step(job, 7, 0, [np.ones(4, np.float32)] * 2)
    before = value(job, 0, 7)
    path = job.root / "ckpt-00000001" / "server-0-of-2.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    message = refused(w0, {0: {"op": "restore", "id": 1, "parts": [[7, 7, 0, 4]]}})
    assert f"{path} holds {len(data) - 8} bytes, but the manifest says {len(data)}" in message
    path.write_bytes(data.replace(b'"<f4"', b'"<U1"', 1))
    assert "a malformed index: dtype <U1" in refused(w0, {0: {"op": "restore", "id": 1, "parts": [[7, 7, 0, 4]]}})
    assert value(job, 0, 7).tobytes() == before.tobytes()


def test_a_restore_onto_a_key_of_another_dtype_is_refused_naming_both(job):
    w0 = job.workers[0]
    commit(job, 1)
    init_keys(job, {20: (0, np.zeros(4, np.int32))})
    message = refused(w0, {0: {"op": "restore", "id": 1, "parts": [[20, 7, 0, 4]]}})
    assert "key 20 holds 4 values of int32 on server 0, but checkpoint 1 has 4 values of float32 of key 7" in message


def test_without_a_checkpoint_directory_every_request_is_refused_saying_how_to_get_one():
    with InProcJob(num_workers=1, num_servers=1, network_threads=False) as job:
        message = refused(job.workers[0], {0: {"op": "scan"}})
    assert "server 0 has no checkpoint directory (PSLAUNCH_CHECKPOINT_DIR); start the job with pslaunch --checkpoint-dir" in message


def test_scan_and_collect_read_only_checkpoint_directories(tmp_path):
    for name in ("ckpt-00000001", "ckpt-00000002", "ckpt-00000005", "other", "ckpt-7"):
        (tmp_path / name).mkdir()
    for name in ("ckpt-00000001", "ckpt-00000002"):
        (tmp_path / name / ck.MANIFEST).write_text("{}")
    assert ck.scan(str(tmp_path)) == (2, 5)
    assert ck.scan(str(tmp_path / "missing")) == (None, None)
    (tmp_path / "ckpt-00000006").mkdir()
    (tmp_path / "ckpt-00000006" / ck.MANIFEST).write_text("{}")
    assert ck.collect(str(tmp_path), 6) == [1, 5]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000002", "ckpt-00000006", "ckpt-7", "other"]


# ---- a worker restarted alone takes its rank back (PSLAUNCH_RESTART_SCOPE=worker) ----------------------
def _record(uid: str, worker_id, job: str = "j") -> dict:
    host, port = uid.split("@")[1].split(":")
    return {"role": "worker", "host": host, "port": int(port), "uid": uid, "fingerprint": "f", "local_name": "n",
            "worker_id": worker_id, "job_id": job}


def _roster() -> Roster:
    roster = Roster(num_workers=2, num_servers=1, job_id="j", port=1)
    for uid, wid in (("worker@h:1", 0), ("worker@h:2", 1)):
        roster.add(uid.encode(), _record(uid, wid))
    roster.assign_ranks()
    return roster


def test_a_restarted_worker_takes_the_rank_of_the_one_it_replaces():
    roster = _roster()
    new, old = roster.replace(b"worker@h:3", _record("worker@h:3", 1))
    assert (new.peer.rank, old.peer.uid) == (1, "worker@h:2")
    assert sorted(m.peer.uid for m in roster.members.values()) == ["worker@h:1", "worker@h:3"]


@pytest.mark.parametrize("record, expected", [
    (_record("worker@h:3", None), "registered after the job started without a DMLC_WORKER_ID of 0..1 (None)"),
    (_record("worker@h:3", 5), "without a DMLC_WORKER_ID of 0..1 (5)"),
    (_record("worker@h:3", 1, job="k"), "a worker of job 'k' at h:3 tried to join; port 1 belongs to job 'j'"),
])
def test_a_late_registration_that_is_no_restarted_worker_is_refused_naming_why(record, expected):
    with pytest.raises(PSNodeError, match=re.escape(expected)):
        _roster().replace(b"worker@h:3", record)


def test_a_rank_that_finished_cannot_be_taken_again():
    roster = _roster()
    next(m for m in roster.members.values() if m.peer.rank == 1).finished = True
    with pytest.raises(PSNodeError, match="worker 1 already finished the job"):
        roster.replace(b"worker@h:3", _record("worker@h:3", 1))


def test_a_long_write_keeps_the_servers_heartbeats_going_and_hands_back_its_error():
    beats = []
    released = threading.Event()

    def beat():  # the writing may finish only once the writer's thread saw two heartbeats go out
        beats.append(threading.current_thread().name)
        if len(beats) == 2:
            released.set()

    assert cf._beating(lambda: released.wait(10) and "written", beat) == "written"
    assert beats == [threading.current_thread().name] * 2  # beats come from the caller, the server's thread
    with pytest.raises(OSError, match="disk full"):
        cf._beating(lambda: (_ for _ in ()).throw(OSError("disk full")), beat)


def test_a_worker_that_stops_without_ending_fails_the_job_one_heartbeat_timeout_after_it_went_silent():
    settings = {"PSLAUNCH_RESTART_SCOPE": "worker", "PS_HEARTBEAT_TIMEOUT": "1"}
    with InProcJob(num_workers=2, num_servers=1, settings=settings, expect_failure=True) as job:
        w0, w1 = job.workers
        w1.receiver.stop()  # hangs: no more heartbeats, and no end pslaunch would restart it after
        with pytest.raises(PeerDiedError, match=r"worker 1 on \S+ died and did not come back within 1 s"):
            w0.barrier(timeout=30)
