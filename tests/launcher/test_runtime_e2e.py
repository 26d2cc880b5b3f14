"""pslaunch with the bundled runtime (``python -m psnode scheduler|server``) end to end.

These tests need the runtime package (issue 3). They skip only while ``psnode/__main__.py`` does
not exist; once the runtime is merged they run.
"""

from __future__ import annotations

import sys

import pytest

from testkit.launcher import REPO, helper, run_pslaunch

pytestmark = pytest.mark.skipif(not (REPO / "psnode" / "__main__.py").exists(),
                                reason="the bundled runtime (psnode/__main__.py) is not in this tree yet")


def _run_sum_job(tmp_path, *options: str, python: bool = False):
    """Run helpers/kv_worker.py as two workers under pslaunch with ``options``; check that the job
    succeeded and that every worker pulled the sum of all workers' pushes. Returns the run.

    ``python`` puts this interpreter before the script (for hosts whose PATH has another python).
    """
    n = 2
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable] if python else []
    res = run_pslaunch(["-n", str(n), *options, "--timeout", "90", *command, helper("kv_worker.py"), str(out)],
                       timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in range(n):
        r, num, lo, hi = (out / f"worker.{rank}.txt").read_text().split()
        assert (int(r), int(num)) == (rank, n)
        assert float(lo) == float(hi) == n * (n + 1) / 2
    return res


def test_local_job_with_bundled_scheduler_and_servers_sums_every_workers_push(tmp_path):
    res = _run_sum_job(tmp_path, "-s", "2", "--launcher", "local")
    assert "stopped by pslaunch" not in res.stderr  # the runtime shuts down by itself


def test_local_job_without_servers_sums_among_the_workers_and_the_summary_says_so(tmp_path):
    res = _run_sum_job(tmp_path, "-s", "0", "--launcher", "local")
    assert "server" not in "".join(line for line in res.stderr.splitlines() if line.startswith("|"))
    assert "allreduce: no servers" in res.stderr and "stopped by pslaunch" not in res.stderr
    assert [line for line in res.stderr.splitlines() if line != line.rstrip()] == []  # the title once was padded


@pytest.mark.mpi
def test_mpi_job_without_servers(tmp_path):
    _run_sum_job(tmp_path, "-s", "0", "--launcher", "mpi")


def test_user_script_for_every_role_runs_mxnet_style(tmp_path):
    _run_sum_job(tmp_path, "-s", "1", "--launcher", "local", "--command-for-all-roles")


def test_ssh_job_with_bundled_runtime_on_loopback_hosts(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    _run_sum_job(tmp_path, "-s", "2", "-H", hosts, *sshd.ssh_flags(), "--env", f"PYTHONPATH:{REPO}", python=True)


@pytest.mark.mpi
def test_mpi_job_with_bundled_runtime(tmp_path):
    _run_sum_job(tmp_path, "-s", "1", "--launcher", "mpi")
