"""The mpi backend with a real Open MPI ``mpirun`` on this machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import pytest

from testkit.launcher import helper, reaped, run_pslaunch, start_pslaunch, wait_for_records, wait_gone

pytestmark = pytest.mark.mpi

TRICKY = ["--lr", "0.1 x", "it's", 'say "hi"', "$HOME", "back\\slash", "*", "", "ü"]



@pytest.fixture(autouse=True)
def _needs_mpirun():
    # Fail, not skip: a CI machine without mpirun must not pass these tests silently.
    if shutil.which("mpirun") is None:
        pytest.fail("no mpirun on PATH: run scripts/test.sh (it installs openmpi-bin)")


def _job(out, *extra, n=2, s=1):
    return ["-n", str(n), "-s", str(s), "--launcher", "mpi", "--command-for-all-roles", "--shutdown-grace", "0.3",
            "--stop-grace", "2", "--env-server", "SLEEP_scheduler:forever", "--env-server", "SLEEP_server:forever",
            *extra, sys.executable, helper("role.py"), str(out)]


def test_one_mpirun_starts_every_role_with_its_contract_env_and_exact_arguments(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, CHECK_VARS="TOKEN,ONLY_W,ONLY_S,PSLAUNCH_MPI_PLAN", TOKEN="tok-value")
    res = run_pslaunch(_job(out, "--env", "TOKEN", "--env", "CHECK_VARS", "--env-worker", "ONLY_W:w v",
                            "--env-worker", "PS_DUMP_worker_1:1",
                            "--env-server", "ONLY_S:s", n=2, s=2) + TRICKY, env=env)
    assert res.returncode == 0, res.stderr
    rec = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(rec) == ["scheduler.0", "server.0", "server.1", "worker.0", "worker.1"]
    for name, r in rec.items():
        role, rank = name.split(".")
        assert r["argv"] == TRICKY
        assert r["env"]["DMLC_ROLE"] == role and r["env"]["PSLAUNCH_RANK"] == rank
        assert r["checked"]["TOKEN"] == "tok-value"
        assert r["checked"]["ONLY_W"] == ("w v" if role == "worker" else None)
        assert r["checked"]["ONLY_S"] == ("s" if role != "worker" else None)
        assert r["checked"]["PSLAUNCH_MPI_PLAN"] is None  # the launcher's transport does not leak
    assert "[worker.1@localhost] worker 1 started" in res.stdout
    listing = (out / "worker.1.ps").read_text()
    assert "launcher.on_node.rank_shim" in listing and "mpirun" in listing
    assert "tok-value" not in listing


def test_a_failing_rank_becomes_the_exit_code_with_its_root_cause(tmp_path, marker):
    res = run_pslaunch(_job(tmp_path, "--env-worker", "SLEEP_worker:30", "--env-worker", "SLEEP_worker_0:0.3",
                            "--env-worker", "EXIT_worker_0:6") + [marker])
    assert res.returncode == 6, res.stderr
    assert "root cause: worker.0@localhost (worker rank 0 on localhost, pid " in res.stderr
    assert "failed first: exit code 6" in res.stderr
    assert wait_gone(marker, 10) == []


def test_mpirun_command_line_holds_variable_names_never_values(tmp_path):
    from launcher import LaunchConfig, make_plan
    from launcher.backends.mpi import mpirun_argv

    plan = make_plan(LaunchConfig(command=("x",), num_workers=2, num_servers=1, scheduler_port=1, backend="mpi"))
    argv = mpirun_argv(plan, "/py", ["PSLAUNCH_MPI_PLAN", "PSLAUNCH_ENV_0"], None, False, as_root=True)
    assert argv[:6] == ["mpirun", "--allow-run-as-root", "--oversubscribe", "--tag-output", "-np", "4"]
    assert argv[-7:] == ["-x", "PSLAUNCH_MPI_PLAN", "-x", "PSLAUNCH_ENV_0", "/py", "-m", "launcher.on_node.rank_shim"]
    assert "--allow-run-as-root" not in mpirun_argv(plan, "/py", [], None, False, as_root=False)


def test_sigkill_of_pslaunch_leaves_no_rank_running(tmp_path, marker):
    out = tmp_path / "out"
    with reaped(start_pslaunch(_job(out, "--env-worker", "SLEEP_worker:forever") + [marker]), marker) as proc:
        wait_for_records(out, 4, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_gone(marker, 15) == []


def test_mpirun_over_ssh_to_loopback_hosts_syncs_places_ranks_and_keeps_env_values_out_of_ps(sshd, tmp_path):
    out = tmp_path / "out"
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2 slots=1", "127.0.0.3 slots=1"])
    env = dict(os.environ, CHECK_VARS="TOKEN", TOKEN="mpi-secret-value")
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "model.cfg").write_text("layers=2\n")
    res = run_pslaunch(_job(out, "--env", "TOKEN", "--env", "CHECK_VARS", "--env-worker", "PS_DUMP_worker_1:1",
                            "--sync-dst-dir", str(dst), *sshd.ssh_flags(), "-H", hosts, n=2, s=2) + TRICKY,
                       env=env, timeout=90, cwd=str(src))
    assert res.returncode == 0, res.stderr
    assert (dst / "model.cfg").read_text() == "layers=2\n"
    rec = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(rec) == ["scheduler.0", "server.0", "server.1", "worker.0", "worker.1"]
    assert all(r["argv"] == TRICKY and r["checked"]["TOKEN"] == "mpi-secret-value" for r in rec.values())
    assert "[worker.1@127.0.0.3] worker 1 started" in res.stdout
    assert rec["worker.0"]["cwd"] == rec["server.1"]["cwd"] == str(dst)
    assert rec["scheduler.0"]["cwd"] == str(src)
    listing = (out / "worker.1.ps").read_text()
    assert "orted" in listing  # mpirun started its daemons over ssh
    assert "mpi-secret-value" not in listing


def test_mpi_with_a_hostfile_runs_the_ssh_preflight_first(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.9:1"])
    res = run_pslaunch(["-n", "2", "--launcher", "mpi", "-H", hosts, *sshd.ssh_flags(), "true"])
    assert res.returncode == 3
    assert "127.0.0.9:1: connection refused on port 1" in res.stderr
