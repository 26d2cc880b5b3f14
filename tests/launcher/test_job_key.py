"""pslaunch gives every job a fresh key and hands it to the runtime through an inherited pipe: never
in a command line (ps), in --dry-run, in the environment of the user's command or of a child it
starts, on the local, ssh and mpi backends; with local and ssh in no process's environment at all
(mpi's own mpirun and ranks carry it in theirs)."""

from __future__ import annotations

import re

import pytest

from testkit.launcher import BATCH_BACKENDS, REPO, backend_launch, helper, run_pslaunch, wait_gone


def _check(res, workers: int, environs: str = r"\[\]") -> None:
    context = f"{res.stdout}\n{res.stderr}"
    assert res.returncode == 0, context
    assert context.count("HAS_KEY True") == workers, context  # the key reached every worker's runtime
    # before kvcore was imported the process had a descriptor number, not the key
    assert context.count("KEY_VARIABLES_BEFORE_IMPORT ['PSLAUNCH_JOB_KEY_FD']") == workers, context
    assert context.count("IN_OWN_ENVIRON False") == workers, context  # not in /proc/self/environ
    assert context.count("IN_A_CHILDS_ENVIRON False") == workers, context  # nor in a child's
    assert context.count("VISIBLE_TO_USER_CODE False") == workers, context  # nor in os.environ after
    assert context.count("IN_A_COMMAND_LINE []") == workers, context  # no argv anywhere holds it
    assert len(re.findall(rf"IN_AN_ENVIRON {environs}$", context, re.M)) == workers, context
    assert context.count("DONE") == workers, context
    assert not re.search(r"\b[0-9a-f]{64}\b", context), context  # nor does pslaunch's own output


# under mpi the key travels in mpirun's environment and its ranks' (launcher.on_node.rank_shim), never further
_MPI_ONLY = r"\[('(mpirun|\S+ -m launcher\.on_node\.rank_shim)[^']*',? ?)+\]"
# under a batch scheduler: in the scheduler's launcher (srun, the SGE job's own steps) and the ranks
_BATCH_ONLY = r"\[('(srun|slurmstepd|sge_shepherd|\S+ -m launcher\.\S+|-sh -c \S+ -m launcher\.)[^']*',? ?)*\]"


@pytest.mark.parametrize("backend", ["local", "mpi"])
def test_the_job_key_is_in_no_command_line_and_not_visible_to_user_code(backend, marker, tmp_path):
    logs = tmp_path / "logs"
    _check(run_pslaunch(["-n", "2", "-s", "1", "--launcher", backend, "--log-dir", str(logs), "python",
                         helper("key_witness.py"), marker], timeout=90), 2, _MPI_ONLY if backend == "mpi" else r"\[\]")
    files = list(logs.iterdir())
    assert len(files) >= 9 and not any(re.search(rb"\b[0-9a-f]{64}\b", f.read_bytes()) for f in files), files
    assert wait_gone(marker, 10) == []


def test_the_job_key_over_ssh_is_in_no_command_line_and_not_visible_to_user_code(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    _check(run_pslaunch(["-n", "2", "-s", "1", "-H", hosts, *sshd.ssh_flags(), "--env", f"PYTHONPATH:{REPO}",
                         "python", helper("key_witness.py"), marker], timeout=90), 2)
    assert wait_gone(marker, 10) == []


def test_dry_run_names_the_key_but_never_shows_it(tmp_path):
    (tmp_path / "train.py").write_text("")  # --dry-run checks that the script is there
    res = run_pslaunch(["-n", "2", "-s", "1", "--dry-run", "--encrypt", "python", "train.py"], timeout=30,
                       cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    # no --env was given: the key is not listed among them, but where the processes get it
    assert "--env (values hidden)" not in res.stdout and "PSLAUNCH_ENCRYPT=curve" in res.stdout
    assert res.stdout.count("the job key: on a file descriptor (PSLAUNCH_JOB_KEY_FD), in no argv or environment") == 4
    assert not re.search(r"[0-9a-f]{64}", res.stdout), res.stdout
    res = run_pslaunch(["-n", "1", "-s", "0", "--dry-run", "--env", "SECRET_TOKEN:zz-top-secret", "python", "train.py"],
                       timeout=30, cwd=str(tmp_path))
    assert "--env (values hidden): SECRET_TOKEN\n" in res.stdout and "zz-top-secret" not in res.stdout


def test_an_encrypted_job_runs(marker):
    res = run_pslaunch(["-n", "2", "-s", "1", "--encrypt", "--launcher", "local", "python", helper("key_witness.py"),
                        marker], timeout=90)
    _check(res, 2)


@pytest.mark.parametrize("backend", BATCH_BACKENDS)
def test_the_job_key_on_a_batch_scheduler_never_reaches_the_users_command(backend, request, tmp_path, marker):
    launch = backend_launch(backend, request, tmp_path)
    _check(launch.run(["-n", "2", "-s", "1", *launch.args, "python", helper("key_witness.py"), marker], timeout=120), 2,
           _BATCH_ONLY)
    assert wait_gone(marker, 10) == []
