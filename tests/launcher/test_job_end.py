"""A finished job ends at once, on every backend; a slow start is no failure under pslaunch."""

from __future__ import annotations

import re
import sys

import pytest

from testkit.launcher import backend_launch, helper, run_pslaunch

_ROW = re.compile(r"^\| (scheduler|server|worker) +\| +(\d+) \| [^|]+\| +[-\d]+ \| ([^|]+?) +\| +[\d.]+s \| ([^|]*?) *\|$", re.M)


def _rows(stderr: str) -> dict[str, tuple[str, str]]:
    return {f"{m[1]}.{m[2]}": (m[3], m[4]) for m in _ROW.finditer(stderr)}


@pytest.mark.parametrize("backend", ["local", "ssh", "mpi", "slurm", "sge"])
def test_when_every_worker_exits_0_without_the_runtime_the_bundled_nodes_end_normally_at_once(
        backend, request, tmp_path):
    launch = backend_launch(backend, request, tmp_path)
    # A shutdown grace longer than the run's time limit: only the end request can finish in time.
    res = launch.run(["-n", "4", "-s", "2", *launch.args, "--shutdown-grace", "300", "python", "-c", "pass"],
                     timeout=60)
    assert res.returncode == 0, res.stderr
    rows = _rows(res.stderr)
    assert sorted(rows) == ["scheduler.0", "server.0", "server.1", "worker.0", "worker.1", "worker.2", "worker.3"]
    assert set(rows.values()) == {("0", "")}, res.stderr  # every process exited 0; nobody was stopped
    assert "stopped by pslaunch" not in res.stderr


def test_a_worker_loading_data_longer_than_the_registration_timeout_does_not_fail_the_job(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # The timeout a hand-started job would die of; under pslaunch the launcher watches liveness.
    res = run_pslaunch(["-n", "2", "-s", "1", "--launcher", "local", "--env", "PSLAUNCH_REGISTER_TIMEOUT:1",
                        "--env-worker", "LOAD_SECONDS:3", sys.executable, helper("kv_worker.py"), str(out)], timeout=60)
    assert res.returncode == 0, res.stderr
    assert (out / "worker.1.txt").read_text().split()[2:] == ["3.0", "3.0"]
    assert "registration timed out" not in res.stderr
