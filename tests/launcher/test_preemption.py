"""A preempted job (SIGTERM to pslaunch: Slurm's ``--signal``, a deleted pod) that keeps checkpoints is
stopped after worker 0 committed one at its next step boundary; pslaunch exits 85 ("preempted,
resumable"), and the same command resumes from that checkpoint to the weights an uninterrupted run
ends with, bit for bit. Without a ``State`` to commit, SIGTERM stops the job as before (143)."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from testkit.launcher import helper, reaped, run_pslaunch, start_pslaunch, wait_gone
from testkit.launcher.outcome import same_weights, saved_weights

pytestmark = pytest.mark.timeout(150)

HELPER = helper("replace_sync.py")


def _args(out, ckpt, *extra):
    return ["-n", "2", "-s", "2", "--no-dashboard", "--env", "PSLAUNCH_BIGARRAY_BOUND:1000", "--env", "STEPS:14",
            "--env", "STEP_SLEEP:0.15", "--env", "PROGRESS:1", "--checkpoint-dir", str(ckpt), "--timeout", "90",
            *extra, "python", HELPER, str(out)]


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _starts(out) -> list[tuple[int, int, int]]:
    return [tuple(map(int, line.split())) for line in (out / "starts.txt").read_text().splitlines()]


def test_sigterm_to_pslaunch_commits_a_checkpoint_at_worker_0s_step_boundary_and_the_same_command_resumes_exactly(
        tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
    res = run_pslaunch(_args(whole, tmp_path / "ckpt-whole"), timeout=120)
    assert res.returncode == 0, res.stderr
    summary = tmp_path / "summary.json"
    with reaped(start_pslaunch(_args(cut, tmp_path / "ckpt", "--summary-json", str(summary))), str(cut)) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_lines(cut / "progress.0.txt")) < 3:  # a few steps in
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 85, err
    assert "pslaunch: got SIGTERM: the job is preempted; worker 0 commits a checkpoint at its next step boundary" in err
    found = re.search(r"root cause: pslaunch got SIGTERM: the job was preempted after worker 0 committed checkpoint "
                      r"(\d+) \(step=(\d+)\); the same command resumes from it", err)
    assert found, err
    step = int(found[2])
    assert 0 < step < 14
    rows = {p["name"]: p for p in json.loads(summary.read_text())["processes"]}
    assert rows["worker.0@localhost"]["note"] == f"preempted: committed checkpoint {found[1]}", rows
    assert not wait_gone(str(cut))
    # the same command again: it resumes from that step and ends with the uninterrupted run's weights
    res = run_pslaunch(_args(cut, tmp_path / "ckpt"), timeout=120)
    assert res.returncode == 0, res.stderr
    assert sorted(s for s in _starts(cut) if s[2] > 0) == [(0, 0, step), (1, 0, step)], _starts(cut)
    assert same_weights(saved_weights(whole), saved_weights(cut))


def test_without_a_state_to_commit_sigterm_stops_the_job_as_before(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with reaped(start_pslaunch(_args(out, tmp_path / "ckpt", "--stop-grace", "30", "--env", "NO_STATE:1")),
                str(out)) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_lines(out / "starts.txt")) < 2:  # both workers are in
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 143, err
    assert "worker 0: preempted, but the job has no kvcore.elastic.State: nothing to commit" in err
    assert "root cause: pslaunch got SIGTERM; worker 0 had nothing to commit (the job has no kvcore.elastic.State)" in err
    assert not wait_gone(str(out))
