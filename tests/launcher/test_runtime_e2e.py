"""pslaunch with the bundled runtime (``python -m psnode scheduler|server``) end to end.

These tests need the runtime package (issue 3). They skip only while ``psnode/__main__.py`` does
not exist; once the runtime is merged they run.
"""

from __future__ import annotations

import sys

import pytest

from launcher_testkit import REPO, helper, run_pslaunch

pytestmark = pytest.mark.skipif(not (REPO / "psnode" / "__main__.py").exists(),
                                reason="the bundled runtime (psnode/__main__.py) is not in this tree yet")


def _check(out, n):
    for rank in range(n):
        r, num, lo, hi = (out / f"worker.{rank}.txt").read_text().split()
        assert (int(r), int(num)) == (rank, n)
        assert float(lo) == float(hi) == n * (n + 1) / 2


def test_local_job_with_bundled_scheduler_and_servers_sums_every_workers_push(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    res = run_pslaunch(["-n", "2", "-s", "2", "--launcher", "local", "--timeout", "90",
                        helper("kv_worker.py"), str(out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _check(out, 2)
    assert "stopped by pslaunch" not in res.stderr  # the runtime shuts down by itself


def test_user_script_for_every_role_runs_mxnet_style(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    res = run_pslaunch(["-n", "2", "-s", "1", "--launcher", "local", "--timeout", "90", "--command-for-all-roles",
                        helper("kv_worker.py"), str(out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _check(out, 2)


def test_ssh_job_with_bundled_runtime_on_loopback_hosts(sshd, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    res = run_pslaunch(["-n", "2", "-s", "2", "-H", hosts, *sshd.ssh_flags(), "--timeout", "90",
                        "--env", f"PYTHONPATH:{REPO}", sys.executable, helper("kv_worker.py"), str(out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _check(out, 2)


def test_mpi_job_with_bundled_runtime(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    res = run_pslaunch(["-n", "2", "-s", "1", "--launcher", "mpi", "--timeout", "90",
                        helper("kv_worker.py"), str(out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _check(out, 2)
