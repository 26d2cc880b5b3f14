"""pslaunch --max-restarts: a job that loses a worker or a server resumes from its last checkpoint and
ends with the weights an uninterrupted run ends with, bit for bit.

Every job runs ``helpers/resume_train.py`` (2 workers, 2 servers, dist_sync, SGD with momentum on the
servers, a key split across the servers, a commit every 5 steps, 60 steps) as real processes under
pslaunch; faults are real: an exception, an exit, a SIGKILL of a server, a server killed in the
middle of a commit.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from testkit.launcher import REPO, helper, run_pslaunch, wait_gone

JOB = ["-n", "2", "-s", "2", "--env", "PSLAUNCH_BIGARRAY_BOUND:1000", "--timeout", "150"]


def _train(out, *options: str, fault: dict | None = None, timeout: float = 200):
    out.mkdir(exist_ok=True)
    env = [a for k, v in (fault or {}).items() for a in ("--env", f"{k}:{v}")]
    res = run_pslaunch([*JOB, *options, *env, helper("resume_train.py"), str(out)], timeout=timeout)
    assert not wait_gone(str(out)), "processes of the job were left running"
    return res


def _resume(out, uninterrupted, restarts: int, **fault: str):
    """Run the job with ``fault`` and ``restarts`` restarts and a checkpoint directory: it must
    succeed and end with the uninterrupted run's weights. Returns the run."""
    res = _train(out, "--max-restarts", str(restarts), "--checkpoint-dir", str(out / "ckpt"), fault=fault)
    assert res.returncode == 0, res.stderr
    assert _weights(out) == uninterrupted
    return res


def _weights(out) -> dict[str, bytes]:
    with np.load(out / "final.npz") as final:
        return {k: final[k].tobytes() for k in final.files}


def _resumed(out, attempt: int) -> tuple[int, str]:
    step, ckpt = (out / f"resumed.{attempt}.0").read_text().split()
    return int(step), ckpt


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of the job run without a fault (and without restarts)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    res = _train(out, "--checkpoint-dir", str(out / "ckpt"))
    assert res.returncode == 0, res.stdout + res.stderr
    return _weights(out)


def test_a_worker_that_raises_at_step_37_is_restarted_with_the_job_and_the_weights_match_bit_for_bit(
        tmp_path, uninterrupted):
    res = _resume(tmp_path, uninterrupted, 1, FAULT="raise", FAULT_RANK="1", FAULT_STEP="37")
    assert _resumed(tmp_path, 0) == (0, "None") and _resumed(tmp_path, 1) == (35, "7")
    assert "RuntimeError: worker 1 fails at step 37" in res.stderr
    assert "restarting the job (restart 1 of 1, PSLAUNCH_RESTART_COUNT=1)" in res.stderr
    attempts = re.findall(r"^pslaunch: attempt (\d): (.*) -> (.*)$", res.stderr, re.M)
    assert [(n, a) for n, _, a in attempts] == [("1", "restarted the job (restart 1 of 1)"),
                                                 ("2", "none: the job succeeded")], res.stderr
    assert attempts[0][1].startswith("worker.1@localhost (worker rank 1 on localhost, pid ")
    assert attempts[0][1].endswith("failed first: exit code 1")


def test_a_server_killed_mid_run_is_restarted_with_the_job_and_the_weights_match_bit_for_bit(tmp_path, uninterrupted):
    # commit(wait=True): a SIGKILL lets no background sync finish, so the test knows which checkpoint is complete
    res = _resume(tmp_path, uninterrupted, 2, FAULT="kill-server", FAULT_RANK="0", FAULT_STEP="23", FAULT_SERVER="1",
                  COMMIT_WAIT="1")
    assert _resumed(tmp_path, 1) == (20, "4")
    assert re.search(r"attempt 1: server\.\d@localhost \(server rank \d on localhost, pid \d+\) failed first: "
                     r"signal SIGKILL -> restarted the job \(restart 1 of 2\)", res.stderr), res.stderr


def test_a_checkpoint_torn_by_a_server_killed_during_the_commit_is_ignored_and_the_previous_one_restored(
        tmp_path, uninterrupted):
    _resume(tmp_path, uninterrupted, 1, FAULT="torn", FAULT_STEP="40", FAULT_SERVER="0")
    seen = json.loads((tmp_path / "listing.1.json").read_text())
    # the commit of step 40 (checkpoint 8): both servers' files written (server 0's may not have been synced and
    # renamed into place before it was killed), no manifest
    names = [n.split(".tmp-")[0].lstrip(".") for n in seen["ckpt-00000008"]]
    assert sorted(names) == ["server-0-of-2.bin", "server-1-of-2.bin"], seen
    assert seen["ckpt-00000007"] == ["MANIFEST.json", "server-0-of-2.bin", "server-1-of-2.bin"], seen
    assert _resumed(tmp_path, 1) == (35, "7")
    # later commits went on (ids after the torn one) and removed it; the two newest complete ones stay
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-00000012", "ckpt-00000013"]


def test_when_restarts_are_exhausted_the_job_exits_with_the_last_root_causes_code(tmp_path):
    summary = tmp_path / "summary.json"
    res = _train(tmp_path, "--max-restarts", "2", "--allow-restart-from-scratch", "--summary-json", str(summary),
                 fault={"FAULT": "exit", "FAULT_ATTEMPT": "any", "FAULT_RANK": "1", "FAULT_STEP": "3"})
    assert res.returncode == 12, res.stderr  # the third attempt's worker exits 10 + 2
    attempts = re.findall(r"^pslaunch: attempt (\d): .* failed first: exit code (\d+) -> (.*)$", res.stderr, re.M)
    assert attempts == [("1", "10", "restarted the job (restart 1 of 2)"),
                        ("2", "11", "restarted the job (restart 2 of 2)"),
                        ("3", "12", "gave up: no restart left (--max-restarts 2)")], res.stderr
    assert res.stderr.rstrip().endswith("pslaunch: exit code 12")
    assert [_resumed(tmp_path, a) for a in range(3)] == [(0, "None")] * 3  # no checkpoint dir: from scratch
    document = json.loads(summary.read_text())  # the attempts are in the summary JSON too, for CI
    assert document["exit_code"] == 12 and document["root_cause"]["process"] == "worker.1@localhost"
    assert [(a["exit_code"], a["action"]) for a in document["attempts"]] == [
        (10, "restarted the job (restart 1 of 2)"), (11, "restarted the job (restart 2 of 2)"),
        (12, "gave up: no restart left (--max-restarts 2)")]


@pytest.mark.parametrize("failing", [1, 0])
def test_restart_scope_worker_restarts_a_failed_async_worker_alone_while_the_others_never_stop(tmp_path, failing):
    # worker 0 too: it placed the keys; its replacement learns their places, as the others do
    res = run_pslaunch(["-n", "2", "-s", "2", "--max-restarts", "1", "--restart-scope", "worker",
                        "--allow-restart-from-scratch", "--timeout", "150", "--env", f"FAIL_RANK:{failing}",
                        helper("rejoin_async.py"), str(tmp_path)], timeout=200)
    assert not wait_gone(str(tmp_path))
    assert res.returncode == 0, res.stderr
    stepping = 1 - failing
    done, total, expected, pid = (tmp_path / f"worker{stepping}.txt").read_text().split()
    assert total == expected and int(done) > 0  # every push of the stepping worker and of both runs of the other, once
    rows = re.findall(r"^\| (worker|server|scheduler) +\| +(\d) \| [^|]+\| +(\d+) \| (\S+) +\| +[\d.]+s \| (.*?) *\|$",
                      res.stderr, re.M)
    assert [r for r in rows if r[:2] == ("worker", str(stepping))] == [("worker", str(stepping), pid, "0", "")]
    assert [(r[3], r[4]) for r in rows if r[:2] == ("worker", str(failing))] == [("1", "failed; restarted alone"),
                                                                                 ("0", "replacement")]
    assert all(r[3] == "0" for r in rows if r[0] != "worker")
    assert "restarting it alone (restart 1 of 1, PSLAUNCH_RESTART_COUNT=1); the other processes go on" in res.stderr


def test_a_torch_script_reads_torchruns_restart_count_and_the_restart_line_speaks_of_no_exit_code():
    # an allreduce job (-s 0): worker 1 exits 3, a code pslaunch keeps for itself (it would exit 1), on the
    # first attempt; the job is restarted and ends 0, so no line may say what pslaunch would have exited with
    res = run_pslaunch(["-n", "2", "-s", "0", "--max-restarts", "1", "--allow-restart-from-scratch", "python",
                        helper("torch_restart.py")], timeout=90)
    assert res.returncode == 0, res.stderr
    seen = set(re.findall(r"rank \d attempt \d of \d restarts", res.stdout))
    assert {"rank 0 attempt 1 of 1 restarts", "rank 1 attempt 1 of 1 restarts"} <= seen, res.stdout
    assert "rank 1 attempt 0 of 1 restarts" not in seen, res.stdout
    assert re.search(r"root cause: worker\.1@\S+ \(worker rank 1 on \S+, pid \d+\) failed first: exit code 3\n", res.stderr)
    assert "pslaunch exits 1" not in res.stderr, res.stderr


def test_restarts_of_a_job_without_servers_ask_for_a_directory_the_workers_reach():
    res = run_pslaunch(["-n", "2", "-s", "0", "--max-restarts", "1", "python", "train.py"], timeout=30)
    assert res.returncode == 2
    assert "give --checkpoint-dir DIR (a directory every worker reaches" in res.stderr and "server" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-restarts", "1"], "--max-restarts 1 without --checkpoint-dir: every restart would begin the training "
                              "from scratch"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--restart-scope", "worker"], "--restart-scope worker restarts a failed worker alone, which needs --max-restarts"),
    (["--max-restarts", "1", "--allow-restart-from-scratch", "--restart-scope", "worker", "--launcher", "mpi"],
     "--restart-scope worker cannot be used with --launcher mpi"),
    (["--max-restarts", "1", "--allow-restart-from-scratch", "--restart-scope", "worker", "--command-for-all-roles"],
     "with --command-for-all-roles use --restart-scope job"),
    (["-s", "0", "--max-restarts", "1", "--restart-scope", "worker"],
     "--restart-scope worker with -s 0: a job without servers keeps its model on the workers"),
])
def test_restart_flags_that_cannot_work_are_refused_before_anything_starts(args, message):
    res = run_pslaunch(["-n", "1", *args, helper("sleeper.py")], timeout=30)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_a_checkpoint_dir_a_server_cannot_create_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = run_pslaunch(["-n", "1", "--checkpoint-dir", str(blocker / "ckpt"), helper("sleeper.py")], timeout=30)
    assert res.returncode == 2, res.stderr
    assert f"this machine: cannot create or write {blocker / 'ckpt'}" in res.stderr
    assert "nothing was started" in res.stderr


def test_the_restart_count_and_checkpoint_dir_reach_every_process(tmp_path):
    res = run_pslaunch(["-n", "1", "--dry-run", "--max-restarts", "3", "--checkpoint-dir", "rel/ckpt",
                        helper("sleeper.py")], timeout=30, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    envs = [line for line in res.stdout.splitlines() if line.strip().startswith("env:")]
    assert len(envs) == 3
    for env in envs:
        assert "PSLAUNCH_RESTART_COUNT=0" in env and f"PSLAUNCH_CHECKPOINT_DIR={tmp_path}/rel/ckpt" in env


def test_over_ssh_servers_on_two_hosts_sharing_the_checkpoint_dir_pass_the_preflight_and_resume(
        sshd, tmp_path, uninterrupted):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    res = _train(tmp_path, "-H", hosts, *sshd.ssh_flags(), "--env", f"PYTHONPATH:{REPO}", "--max-restarts", "1",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), fault={"FAULT": "raise", "FAULT_STEP": "12"})
    assert res.returncode == 0, res.stderr
    assert _resumed(tmp_path, 1) == (10, "2") and _weights(tmp_path) == uninterrupted
    assert not list((tmp_path / "ckpt").glob(".pslaunch-probe-*"))  # the pre-flight's probe is gone


@pytest.mark.mpi
def test_under_mpi_the_restarted_job_is_a_new_mpirun_and_resumes_bit_for_bit(tmp_path, uninterrupted):
    res = _train(tmp_path, "--launcher", "mpi", "--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 fault={"FAULT": "raise", "FAULT_STEP": "37"})
    assert res.returncode == 0, res.stderr
    assert _resumed(tmp_path, 1) == (35, "7") and _weights(tmp_path) == uninterrupted
    assert "attempt 2: every worker finished -> none: the job succeeded" in res.stderr


@pytest.mark.parametrize("scope", ["job", "worker"])
def test_the_root_cause_after_a_restart_quotes_that_processs_own_lines(scope):
    # worker 1 fails on every start; its lines of the first start must not be quoted for the second
    code = ("import os, sys, time; c = os.environ['PSLAUNCH_RESTART_COUNT']; "
            "print(f'start {c} pid {os.getpid()}', flush=True); "
            "time.sleep(60) if os.environ['DMLC_WORKER_ID'] == '0' else sys.exit(7)")
    res = run_pslaunch(["-n", "2", "-s", "0", "--max-restarts", "1", "--allow-restart-from-scratch",
                        *(["--restart-scope", "worker", "-s", "1"] if scope == "worker" else []),
                        "--timeout", "60", "python", "-c", code], timeout=90)
    assert res.returncode == 7, res.stderr
    cause = re.findall(r"^pslaunch: root cause: worker\.1@localhost \(worker rank 1 on localhost, pid (\d+)\)", res.stderr, re.M)
    assert cause, res.stderr
    quoted = res.stderr[res.stderr.rfind("pslaunch: last lines of worker.1@localhost:"):]
    assert re.findall(r"\| start (\d) pid (\d+)$", quoted, re.M) == [("1", cause[-1])], res.stderr
