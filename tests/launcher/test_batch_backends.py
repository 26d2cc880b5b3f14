"""The slurm and sge backends on real one-machine clusters that the test session starts.

Every test runs on both schedulers (the ``cluster`` fixture); Slurm's allocation handling has a few
tests of its own. The clusters are session fixtures (conftest.py): started once, stopped at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.launcher import (
    PSLAUNCH,
    REPO,
    Cluster,
    helper,
    reaped,
    run_pslaunch,
    start_pslaunch,
    wait_for_records,
    wait_gone,
)

TRICKY = ["--lr", "0.1 x", "it's", 'say "hi"', "$HOME", "back\\slash", "*", "", "ü"]
SECRET = "job-key-3f9a1c7e"
TRAIN_ARGS = ["--epochs", "4"]
EPOCH = re.compile(r"worker (\d+) epoch (\d+) test_accuracy ([0-9.]+)")


@pytest.fixture(params=["slurm", "sge"])
def cluster(request) -> Cluster:
    """Each test once on the Slurm cluster and once on the SGE cluster."""
    return request.getfixturevalue(request.param)


def _job(cluster: Cluster, out: Path, *extra: str, n: int = 2, s: int = 1, together: bool = False) -> list[str]:
    """role.py as every role. ``together``: every role ends by itself at about the same time, so a
    scheduler or server seen ending before the workers (by a moment, or longer on a loaded machine)
    is no failure; otherwise they run until stopped, soon after the workers end."""
    grace = "60" if together else "0.5"
    return ["-n", str(n), "-s", str(s), "--launcher", cluster.kind, "--command-for-all-roles", "--shutdown-grace", grace,
            "--stop-grace", "2", "--timeout", "90", *extra, sys.executable, helper("role.py"), str(out)]


def _env(cluster: Cluster, **extra: str) -> dict[str, str]:
    return cluster.client_env(dict(os.environ, **extra))


def _records(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_every_role_runs_with_its_env_exact_arguments_and_a_forwarded_secret(cluster, tmp_path, marker):
    out, release = tmp_path / "out", tmp_path / "release"
    env = _env(cluster, PSLAUNCH_JOB_KEY=SECRET, CHECK_VARS="PSLAUNCH_JOB_KEY,ONLY_W,PSLAUNCH_MPI_PLAN")
    args = _job(cluster, out, "--env", "PSLAUNCH_JOB_KEY", "--env", "CHECK_VARS", "--env-worker", "ONLY_W:w v",
                "--env-worker", "PS_DUMP_worker_1:1", *(f"--env=SLEEP_{role}:until:{release}" for role in
                                                         ("scheduler", "server", "worker")), n=2, s=2,
                together=True) + TRICKY + [marker]
    with reaped(start_pslaunch(args, cwd=str(tmp_path), env=env), marker) as proc:
        wait_for_records(out, 5, proc, timeout=60)
        # what the scheduler shows and stores: test_secrets_reach_the_job_only_through_its_environment...
        if cluster.kind == "sge":  # the hand-over file is the only place it is written, 0600 in a 0700 dir
            (jobdir,) = tmp_path.glob(".pslaunch-sge-*")
            assert (jobdir.stat().st_mode & 0o777, (jobdir / "plan.json").stat().st_mode & 0o777) == (0o700, 0o600)
        release.touch()
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    rec = _records(out)
    assert sorted(rec) == ["scheduler.0", "server.0", "server.1", "worker.0", "worker.1"]
    for name, r in rec.items():
        role, rank = name.split(".")
        assert r["argv"] == TRICKY + [marker]
        assert r["cwd"] == str(tmp_path)
        assert r["env"]["DMLC_ROLE"] == role and r["env"]["PSLAUNCH_RANK"] == rank
        assert r["env"]["DMLC_PS_ROOT_URI"] == cluster.node and r["env"]["DMLC_NUM_SERVER"] == "2"
        assert r["checked"]["PSLAUNCH_JOB_KEY"] == SECRET
        assert r["checked"]["ONLY_W"] == ("w v" if role == "worker" else None)
        assert r["checked"]["PSLAUNCH_MPI_PLAN"] is None  # the launcher's transport does not leak
    assert f"[worker.1@{cluster.node}] worker 1 started" in stdout.decode()
    listing = (out / "worker.1.ps").read_text()
    assert "launcher.on_node.rank_shim" in listing and SECRET not in listing
    assert cluster.wait_no_jobs() == []
    assert list(tmp_path.glob(".pslaunch-*")) == []


def test_a_failing_worker_gives_its_exit_code_and_name_and_leaves_nothing(cluster, tmp_path, marker):
    res = run_pslaunch(_job(cluster, tmp_path / "out", "--env-server", "SLEEP_scheduler:forever", "--env-server",
                            "SLEEP_server:forever", "--env-worker", "SLEEP_worker:forever", "--env-worker",
                            "SLEEP_worker_0:0.5", "--env-worker", "EXIT_worker_0:6") + [marker],
                       env=_env(cluster), cwd=str(tmp_path), timeout=90)
    assert res.returncode == 6, res.stderr
    assert f"root cause: worker.0@{cluster.node} (worker rank 0 on {cluster.node}, pid " in res.stderr
    assert "failed first: exit code 6" in res.stderr
    assert cluster.wait_no_jobs() == []
    assert wait_gone(marker, 15) == []


@pytest.mark.parametrize("how", ["SIGINT", "SIGHUP", "SIGKILL"])
def test_ctrl_c_sighup_or_sigkill_of_pslaunch_leaves_nothing_queued_or_running(cluster, tmp_path, marker, how):
    out = tmp_path / "out"
    args = _job(cluster, out, "--env-server", "SLEEP_scheduler:forever", "--env-server", "SLEEP_server:forever",
                "--env-worker", "SLEEP_worker:forever") + [marker]
    with reaped(start_pslaunch(args, cwd=str(tmp_path), env=_env(cluster)), marker) as proc:
        wait_for_records(out, 4, proc, timeout=60)
        assert cluster.jobs()
        os.kill(proc.pid, getattr(signal, how))
        _, stderr = proc.communicate(timeout=60)
        if how != "SIGKILL":
            assert proc.returncode == 128 + getattr(signal, how), stderr.decode()
            assert f"root cause: pslaunch got {how}" in stderr.decode()
            assert "stopped by pslaunch" in stderr.decode()  # the summary table came out
        assert cluster.wait_no_jobs(30) == []
        assert wait_gone(marker, 15) == []
    assert list(tmp_path.glob(".pslaunch-*")) == []  # also the file with the --env values


def test_secrets_reach_the_job_only_through_its_environment_and_the_key_through_its_pipe(cluster, tmp_path, marker):
    out, token = tmp_path / "out", f"token-{marker}"
    names = ["API_TOKEN", "PSLAUNCH_JOB_KEY"]  # forwarded with --env; made by pslaunch for the job
    res = run_pslaunch(["-n", "1", "-s", "1", "--launcher", cluster.kind, "--timeout", "90", "--env", "API_TOKEN",
                        "python", helper("secret_witness.py"), str(out), str(cluster.dir), *names],
                       env=_env(cluster, API_TOKEN=token), cwd=str(tmp_path), timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "witness.json").read_text())
    assert report["job"] and all(report["looked_at_own_job"].values()), report
    for name in names:
        assert report[name]["present"] and report[name]["seen_in"] == [], (name, report)
    assert report["PSLAUNCH_JOB_KEY"]["length"] == 64, report
    assert token not in res.stdout + res.stderr
    assert not re.search(r"\b[0-9a-f]{64}\b", res.stdout + res.stderr)  # nor the key
    assert cluster.wait_no_jobs() == []
    assert list(tmp_path.glob(".pslaunch-*")) == []


def test_a_job_the_scheduler_cannot_place_fails_at_once_with_a_clear_error(cluster, tmp_path):
    res = run_pslaunch(["-n", "20", "-s", "2", "--launcher", cluster.kind, "true"], env=_env(cluster),
                       cwd=str(tmp_path), timeout=60)
    assert res.returncode == 2, res.stderr
    if cluster.kind == "slurm":  # 23 tasks on 8 CPUs: pending for a reason that waiting does not cure
        assert "Slurm will not run the allocation pslaunch asked for (salloc --no-shell -n 23 -J pslaunch-" in res.stderr
        assert "pending with reason PartitionConfig" in res.stderr
    else:
        assert "SGE refused the job (qsub -terse -sync y -w e" in res.stderr and "-pe smp 23" in res.stderr
        assert "no suitable queues" in res.stderr
    assert cluster.wait_no_jobs() == []


def test_on_a_busy_cluster_pslaunch_waits_says_why_and_timeout_cancels_its_pending_job(cluster, tmp_path):
    if cluster.kind == "slurm":  # every CPU taken by another allocation
        blocker = cluster.tool("salloc", "--no-shell", "-n", "8", "-J", "blocker")
        job = re.search(r"Granted job allocation (\d+)", blocker.stderr).group(1)
    else:
        blocker = cluster.tool("qsub", "-terse", "-pe", "smp", "8", "-N", "blocker", "-o", "/dev/null", "-e", "/dev/null",
                               "-b", "y", "sleep", "600")
        job = blocker.stdout.strip()
    try:
        assert blocker.returncode == 0, blocker.stderr
        deadline = time.monotonic() + 30
        while cluster.kind == "sge" and "  r  " not in cluster.tool("qstat", "-j", job, "-ext").stdout + \
                cluster.tool("qstat").stdout and time.monotonic() < deadline:
            time.sleep(0.2)
        res = run_pslaunch(["-n", "1", "-s", "1", "--launcher", cluster.kind, "--timeout", "5", "true"],
                           env=_env(cluster), cwd=str(tmp_path), timeout=60)
        assert res.returncode == 124, res.stderr
        waiting = "waiting for Slurm to grant job" if cluster.kind == "slurm" else "waiting for SGE to start job"
        assert waiting in res.stderr and "after --timeout 5 s" in res.stderr
        assert cluster.wait_no_jobs(1) == [job]  # pslaunch's own job is gone, the other one still runs
    finally:
        cluster.tool("scancel" if cluster.kind == "slurm" else "qdel", job)
    assert cluster.wait_no_jobs() == []


def test_scheduler_options_pass_through_and_a_missing_parallel_environment_is_named(cluster, tmp_path):
    if cluster.kind == "slurm":
        res = run_pslaunch(["-n", "1", "--launcher", "slurm", "--slurm-args", "-p nosuchpartition", "true"],
                           env=_env(cluster), cwd=str(tmp_path), timeout=60)
        assert res.returncode == 2, res.stderr
        assert "Slurm refused the allocation (salloc --no-shell -p nosuchpartition -n 3" in res.stderr
        assert "invalid partition specified: nosuchpartition" in res.stderr.lower()
    else:
        res = run_pslaunch(["-n", "1", "--launcher", "sge", "--sge-pe", "mpi", "true"], env=_env(cluster),
                           cwd=str(tmp_path), timeout=60)
        assert res.returncode == 2, res.stderr
        assert "SGE has no parallel environment 'mpi' (qconf -sp mpi: mpi is not a parallel environment)" in res.stderr
        res = run_pslaunch(["-n", "1", "--launcher", "sge", "--sge-args", "-q nosuchqueue", "true"], env=_env(cluster),
                           cwd=str(tmp_path), timeout=60)
        assert res.returncode == 2, res.stderr
        assert "-q nosuchqueue" in res.stderr
    assert cluster.wait_no_jobs() == []


def test_inside_a_slurm_allocation_the_job_runs_as_a_step_of_it(slurm, tmp_path):
    out = tmp_path / "out"
    env = _env(slurm, CHECK_VARS="SLURM_JOB_ID,SLURM_JOB_NAME",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["salloc", "-n", "6", "-J", "outer-allocation", *PSLAUNCH, *_job(slurm, out, "--env", "CHECK_VARS", together=True)]
    res = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr
    rec = _records(out)
    assert sorted(rec) == ["scheduler.0", "server.0", "worker.0", "worker.1"]
    # every process ran in the allocation pslaunch was started in, none in one it asked for itself
    outer = re.search(r"Granted job allocation (\d+)", res.stderr)
    assert outer and {r["checked"]["SLURM_JOB_ID"] for r in rec.values()} == {outer.group(1)}, res.stderr
    assert {r["checked"]["SLURM_JOB_NAME"] for r in rec.values()} == {f"pslaunch-{rec['worker.0']['env']['PSLAUNCH_JOB_ID']}"}
    assert slurm.wait_no_jobs() == []


def test_slurm_args_reach_the_allocation(slurm, tmp_path, marker):
    out, release = tmp_path / "out", tmp_path / "release"
    # every role waits for the release: the listing and scontrol below may take a while on a busy machine
    args = _job(slurm, out, "--slurm-args", "-t 7 --comment 'two words'",
                *(f"--env=SLEEP_{role}:until:{release}" for role in ("scheduler", "server", "worker")), together=True)
    with reaped(start_pslaunch(args + [marker], cwd=str(tmp_path), env=_env(slurm)), marker) as proc:
        wait_for_records(out, 4, proc, timeout=60)
        (job,) = [j for j in slurm.jobs() if "." not in j]
        shown = slurm.tool("scontrol", "show", "job", job).stdout
        release.touch()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    assert "TimeLimit=00:07:00" in shown and "Comment=two words" in shown


def test_a_node_an_earlier_test_left_drained_is_resumed_before_the_next_test_and_runs_its_job(slurm_cluster, tmp_path):
    # what slurmctld does to the node when a job step outlives its cancel ("Kill task failed")
    res = slurm_cluster.tool("scontrol", "update", f"NodeName={slurm_cluster.node}", "State=DRAIN",
                             "Reason=Kill task failed")
    assert res.returncode == 0, res.stderr
    assert slurm_cluster.back_in_service() == "drained: Kill task failed"
    assert slurm_cluster.back_in_service() is None  # in service now: nothing to do
    out = tmp_path / "out"
    res = run_pslaunch(_job(slurm_cluster, out, together=True), env=_env(slurm_cluster), cwd=str(tmp_path), timeout=120)
    assert res.returncode == 0, res.stderr
    assert sorted(_records(out)) == ["scheduler.0", "server.0", "worker.0", "worker.1"]


def _curves(output: str) -> dict[int, list[float]]:
    curves: dict[int, list[float]] = {}
    for worker, epoch, acc in EPOCH.findall(output):
        curves.setdefault(int(worker), []).append(float(acc))
    return curves


def _train(*options: str, env: dict | None = None, cwd: str | None = None) -> dict[int, list[float]]:
    res = run_pslaunch(["-n", "2", "-s", "1", *options, "--timeout", "150", sys.executable,
                        str(REPO / "examples" / "train_mlp.py"), *TRAIN_ARGS], env=env, cwd=cwd, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    curves = _curves(res.stdout)
    assert sorted(curves) == [0, 1] and all(len(c) == int(TRAIN_ARGS[1]) for c in curves.values()), res.stdout
    return curves


@pytest.fixture(scope="module")
def local_curves() -> dict[int, list[float]]:
    """The training example's accuracy per epoch with the same job run locally."""
    return _train("--launcher", "local")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_training_example_on_the_cluster_reaches_the_same_accuracy_as_locally(cluster, local_curves, tmp_path):
    curves = _train("--launcher", cluster.kind, env=_env(cluster), cwd=str(tmp_path))
    assert curves == local_curves  # the same data, seeds and sums: the same model, epoch by epoch
    assert curves[0][-1] >= 0.9, curves
    assert cluster.wait_no_jobs() == []


# -- without a cluster: command lines, --dry-run, refused flags ------------------------------------

def _plan_with_secret(backend: str):
    from launcher import EnvVar, LaunchConfig, make_plan
    from launcher.backends import get_backend

    config = LaunchConfig(command=("train.py", "--lr", "0.1 x"), num_workers=2, num_servers=1, scheduler_port=9000,
                          backend=backend, python="/py", job_id="j1", env=(EnvVar("PSLAUNCH_JOB_KEY", SECRET),))
    config = get_backend(backend).configure(config, {})
    return config, make_plan(config)


def test_scheduler_command_lines_hold_names_and_paths_never_values():
    from launcher.backends.sge import qsub_argv
    from launcher.backends.slurm import salloc_argv, srun_argv

    _, plan = _plan_with_secret("slurm")
    assert salloc_argv(4, "pslaunch-j1", ["-p", "gpu"]) == ["salloc", "--no-shell", "-p", "gpu", "-n", "4", "-J",
                                                             "pslaunch-j1"]
    srun = srun_argv("12", plan, "pslaunch-j1", "/py", [])
    assert srun[:4] == ["srun", "--jobid", "12", "-J"] and "--distribution=arbitrary" in srun and "--label" in srun
    assert srun[-6:] == ["/py", "-m", "launcher.on_node.rank_shim", "--rank-from", "SLURM_PROCID", "--no-forward"]
    qsub = qsub_argv("pslaunch-j1", "smp", 4, "/d", "/py", "/repo", ["-q", "all.q"])
    assert qsub[qsub.index("-pe"):qsub.index("-pe") + 3] == ["-pe", "smp", "4"]
    assert qsub[-11:] == ["-v", "PYTHONPATH=/repo", "-q", "all.q", "-b", "y", "/py", "-m", "launcher.on_node.sge_job",
                          "master", "/d"]
    assert qsub[qsub.index("-v") + 1] == "PYTHONPATH=/repo"
    assert "-V" not in qsub and [a for a in qsub if a.startswith("PSLAUNCH")] == []
    assert SECRET not in " ".join(srun + qsub)


@pytest.mark.parametrize("backend,command", [("slurm", "salloc --no-shell -p debug -n 4 -J pslaunch-j1"),
                                             ("sge", "-pe smp 4 -cwd")])
def test_dry_run_outside_a_job_shows_placeholder_hosts_and_what_pslaunch_will_ask(backend, command):
    args = ["-n", "2", "-s", "1", "--launcher", backend, "--dry-run", "--job-id", "j1", "--env", "PSLAUNCH_JOB_KEY"]
    args += ["--slurm-args", "-p debug"] if backend == "slurm" else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    res = run_pslaunch([*args, "train.py"], env=dict(env, PSLAUNCH_JOB_KEY=SECRET))
    assert res.returncode == 0, res.stderr
    placeholder = f"<{backend}-{'node' if backend == 'slurm' else 'host'}>"
    assert f"worker.1@{placeholder}  (local rank 1/2, via {backend})" in res.stdout
    assert f"scheduler at {placeholder}:" in res.stdout and command in res.stdout
    assert "PSLAUNCH_JOB_KEY" in res.stdout and SECRET not in res.stdout + res.stderr


@pytest.mark.parametrize("args,message", [
    (["--launcher", "slurm", "--sge-args", "-q a"], "--sge-args is not an option of --launcher slurm"),
    (["--launcher", "local", "--slurm-args", "-p a"], "--slurm-args is not an option of --launcher local"),
    (["--launcher", "sge", "--scheduler-host", "h1"], "--launcher sge runs the scheduler on the job's first host; "
                                                      "drop --scheduler-host h1"),
    (["--launcher", "slurm", "--sync-dst-dir", "/x"], "--sync-dst-dir is for the ssh and mpi backends"),
    (["--launcher", "slurm", "--slurm-args", "-p 'gpu"], "--slurm-args \"-p 'gpu\": No closing quotation"),
    (["--launcher", "sge", "--sge-args", "-q a -V"], "--sge-args -V would store pslaunch's whole environment, --env "
                                                     "values included, in the qmaster's spool"),
    (["--launcher", "sge", "--sge-args", "-pe mpi 4"], "name the parallel environment with --sge-pe"),
])
def test_flags_a_batch_backend_cannot_use_are_refused_naming_them(args, message):
    res = run_pslaunch(["-n", "1", *args, "--dry-run", "true"])
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("pslaunch: error: ") and message in res.stderr


def test_dry_run_inside_an_allocation_places_processes_on_its_nodes(slurm, tmp_path):
    env = _env(slurm, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["salloc", "-n", "5", *PSLAUNCH, "-n", "2", "-s", "1", "--launcher", "slurm", "--dry-run", "train.py"]
    res = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"worker.1@{slurm.node}  (local rank 1/2, via slurm)" in res.stdout
    assert re.search(rf"slurm: allocation \d+: {slurm.node} slots=5; one srun step of 4 tasks", res.stdout), res.stdout
    argv[argv.index("-n", 3) + 1] = "6"  # more workers than the allocation has slots
    res = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert re.search(rf"pslaunch: error: 6 workers do not fit the 5 slots of Slurm allocation \d+ \({slurm.node} "
                     r"slots=5: CPUs / CPUs per task\); lower -n", res.stderr), res.stderr
    assert slurm.wait_no_jobs() == []


def test_job_nodes_and_pe_hosts_are_read_from_the_schedulers_own_formats():
    from launcher.backends.slurm import parse_job_nodes
    from launcher.on_node.sge_job import read_pe_hostfile

    text = ("JobId=7 JobName=x NumNodes=3 NumCPUs=10 NumTasks=5 CPUs/Task=2 ReqB:S:C:T=0:0:*:*   "
            "Nodes=n[1-2] CPU_IDs=0-3 Mem=0 GRES= Nodes=n3 CPU_IDs=0,2 Mem=0 GRES= MinCPUsNode=2")
    assert parse_job_nodes(text) == ([("n[1-2]", 4), ("n3", 2)], 2)
    pe = "h1 4 all.q@h1 UNDEFINED\nh2 2 all.q@h2 UNDEFINED\nh1 1 fast.q@h1 UNDEFINED\n"
    assert read_pe_hostfile(pe) == [("h1", 5), ("h2", 2)]


def test_the_watchdog_runs_cleanup_commands_when_pslaunch_dies_unless_cleared(tmp_path):
    for clear, expected in ((False, True), (True, False)):
        flag = tmp_path / f"ran-{clear}"
        watchdog = subprocess.Popen([sys.executable, "-m", "launcher.on_node.watchdog", "1"], stdin=subprocess.PIPE, cwd=REPO)
        lines = f'run ["touch", "{flag}"]\nrun not-json\n' + ("clear\n" if clear else "")
        watchdog.communicate(lines.encode(), timeout=30)  # EOF: what pslaunch's death looks like
        assert flag.exists() is expected
