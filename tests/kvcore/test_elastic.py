"""kvcore.elastic.State with real scheduler, server and worker processes on 127.0.0.1: a checkpoint
restored onto another number of servers, before or after ``kv.init``, resumes bit for bit; a key of
another shape is refused on every worker; the shared model resumes too."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from testkit import LocalJob

SCRIPTS = Path(__file__).parent / "dist_scripts"
BOUND = {"PSLAUNCH_BIGARRAY_BOUND": "1000"}  # key 1 (3000 values) is split across the servers


def run(script: str, out: Path, phase: str, servers: int, ckpt: Path | None, workers: int = 2) -> list:
    env = {**BOUND, **({"PSLAUNCH_CHECKPOINT_DIR": str(ckpt)} if ckpt else {})}
    with LocalJob(workers, servers, worker=[str(SCRIPTS / script), str(out), phase], env=env) as job:
        results = job.wait(90)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(str(r) for r in failed)
    oks = sorted(int(m) for r in results if r.role == "worker" for m in re.findall(r"^OK (\d+)", r.output, re.M))
    assert oks == list(range(workers)), "\n".join(str(r) for r in results)
    return [r for r in results if r.role == "worker"]


def weights(path: Path) -> dict[str, bytes]:
    with np.load(path) as data:
        return {k: data[k].tobytes() for k in data.files}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job of 2 servers that committed checkpoint 1 after 3 steps; the weights after step 4."""
    out = tmp_path_factory.mktemp("saved")
    workers = run("elastic_state.py", out, "save", 2, out / "ckpt")
    assert all("COMMITTED 1" in r.output for r in workers)
    return out


@pytest.mark.parametrize("phase, servers", [("init-first", 3), ("restore-first", 1), ("init-first", 2)])
def test_a_restore_onto_any_number_of_servers_before_or_after_init_resumes_bit_for_bit(saved, tmp_path, phase, servers):
    ckpt = tmp_path / "ckpt"
    (saved / "ckpt").rename(ckpt)
    try:
        run("elastic_state.py", tmp_path, phase, servers, ckpt)
    finally:
        ckpt.rename(saved / "ckpt")
    assert weights(tmp_path / f"{phase}-{servers}.npz") == weights(saved / "saved.npz")


def test_a_commit_completed_in_the_background_that_fails_raises_from_wait_on_every_worker(tmp_path):
    workers = run("elastic_state.py", tmp_path, "sync-fails", 2, tmp_path / "ckpt")
    for r in workers:
        assert re.search(r"^FAILED completing checkpoint 2 failed: .*checkpoint 2 is not complete: server 1: cannot sync "
                         r"the checkpoint file \S+/ckpt-00000002/server-1-of-2\.bin to disk: (Is a directory|Directory "
                         r"not empty)$", r.output, re.M), r
    listing = {p.name: sorted(q.name for q in p.iterdir()) for p in (tmp_path / "ckpt").iterdir()}
    # the torn checkpoint 2 was removed after commit 3; the two newest complete ones stay
    assert listing == {f"ckpt-0000000{i}": ["MANIFEST.json", "server-0-of-2.bin", "server-1-of-2.bin"]
                       for i in (1, 3)}, listing


def test_init_of_a_restored_key_with_another_shape_fails_on_every_worker_naming_both(saved, tmp_path):
    workers = run("elastic_state.py", tmp_path, "mismatch", 2, saved / "ckpt")
    for r in workers:
        assert ("MISMATCH key 0 is initialised with shape (3, 4) and dtype float32, but the checkpoint restored holds "
                "shape (4, 3) and dtype float32 for it") in r.output, r


def test_without_a_checkpoint_directory_commit_keeps_nothing_and_says_so(tmp_path):
    for r in run("elastic_state.py", tmp_path, "no-dir", 1, None):
        assert "WARNED State.commit(): the job has no checkpoint directory" in r.output, r


def test_a_dist_shared_model_resumes_from_its_checkpoint_instead_of_its_initial_weights(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run("elastic_shared_model.py", tmp_path, "save", 2, ckpt)
    assert all("START 1.0" in r.output and "FINAL 11.0" in r.output for r in first), first
    again = run("elastic_shared_model.py", tmp_path, "restore", 2, ckpt)
    assert all("START 7.0" in r.output and "FINAL 11.0" in r.output for r in again), again
