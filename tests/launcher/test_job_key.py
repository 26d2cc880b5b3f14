"""pslaunch gives every job a fresh key, in the environment only: never in a command line (ps), in
--dry-run, or in what user code sees, on the local, ssh and mpi backends."""

from __future__ import annotations

import re

import pytest

from testkit.launcher import REPO, helper, run_pslaunch, wait_gone


def _check(res, workers: int) -> None:
    context = f"{res.stdout}\n{res.stderr}"
    assert res.returncode == 0, context
    assert context.count("HAS_KEY True") == workers, context  # the key reached every worker's process
    assert context.count("VISIBLE_TO_USER_CODE False") == workers, context  # gone before user code ran
    assert context.count("IN_A_COMMAND_LINE []") == workers, context  # no argv anywhere holds it
    assert context.count("DONE") == workers, context
    assert not re.search(r"\b[0-9a-f]{64}\b", context), context  # nor does pslaunch's own output


@pytest.mark.parametrize("backend", ["local", "mpi"])
def test_the_job_key_is_in_no_command_line_and_not_visible_to_user_code(backend, marker):
    _check(run_pslaunch(["-n", "2", "-s", "1", "--launcher", backend, "python", helper("key_witness.py"), marker],
                        timeout=90), 2)
    assert wait_gone(marker, 10) == []


def test_the_job_key_over_ssh_is_in_no_command_line_and_not_visible_to_user_code(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    _check(run_pslaunch(["-n", "2", "-s", "1", "-H", hosts, *sshd.ssh_flags(), "--env", f"PYTHONPATH:{REPO}",
                         "python", helper("key_witness.py"), marker], timeout=90), 2)
    assert wait_gone(marker, 10) == []


def test_dry_run_names_the_key_but_never_shows_it():
    res = run_pslaunch(["-n", "2", "-s", "1", "--dry-run", "--encrypt", "python", "train.py"], timeout=30)
    assert res.returncode == 0, res.stderr
    assert "--env (values hidden): PSLAUNCH_JOB_KEY" in res.stdout and "PSLAUNCH_ENCRYPT=curve" in res.stdout
    assert not re.search(r"[0-9a-f]{64}", res.stdout), res.stdout


def test_an_encrypted_job_runs(marker):
    res = run_pslaunch(["-n", "2", "-s", "1", "--encrypt", "--launcher", "local", "python", helper("key_witness.py"),
                        marker], timeout=90)
    _check(res, 2)
