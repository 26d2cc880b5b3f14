"""``pslaunch --launcher ray`` on a real Ray cluster the module starts: a head in this namespace and a
second node in a network namespace (``testkit.launcher.raycluster``; addresses in 198.18.0.0/15,
unreachable from the machine's real routes), so the placement group really spans two hosts.

Marked ``ray`` (a group of its own: ``pytest -m ray``); they skip, saying why, only when Ray cannot
start here. Every test checks that nothing is left: no process of the job, no actor, no placement
group. The killed raylet comes last: the module's second node is then gone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from testkit.launcher import PSLAUNCH, REPO, helper, run_pslaunch, wait_gone

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ray_cluster():
    from testkit.launcher.raycluster import RayCluster, RayClusterError, ray_usable

    why = ray_usable()
    if why is not None:
        pytest.skip(why)
    try:
        cluster = RayCluster(head_cpus=3, node_cpus=3).__enter__()
    except RayClusterError as exc:
        pytest.skip(f"Ray cannot start a cluster on this machine: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()


def _ray(cluster, args, timeout=120, env=None):
    return run_pslaunch(["--launcher", "ray", *args], timeout=timeout, cwd=str(REPO), env=cluster.driver_env(env))


def _final_accuracies(output: str) -> dict[int, float]:
    return {int(rank): float(acc) for rank, acc in re.findall(r"worker (\d+) final test_accuracy ([\d.]+)", output)}


def _nothing_left(cluster, marker=None):
    assert cluster.wait_empty() == {"placement_groups": [], "actors": []}
    if marker is not None:
        assert wait_gone(marker, 10) == []


def _started(cluster, args, out):
    """pslaunch --launcher ray in the background, its output to files (no pipe to fill)."""
    env = cluster.driver_env()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    with open(out / "stdout", "wb") as stdout, open(out / "stderr", "wb") as stderr:
        return subprocess.Popen([*PSLAUNCH, "--launcher", "ray", *args], stdout=stdout, stderr=stderr, cwd=str(REPO),
                                env=env, start_new_session=True)


def _wait_for_line(proc, path, text, timeout=60):
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"pslaunch ended first: {path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {path.read_text()}"
        time.sleep(0.1)


@pytest.mark.parametrize("servers", ["2", "0"])
def test_the_digits_example_trains_on_two_ray_nodes_to_the_local_launchers_accuracy(ray_cluster, tmp_path, servers):
    words = ["-n", "2", "-s", servers, "examples/train_mlp.py", "--epochs", "6"]
    summary, trace = tmp_path / "summary.json", tmp_path / "trace.json"
    started = time.monotonic()
    res = _ray(ray_cluster, ["--summary-json", str(summary), "--timeline", str(trace), *words])
    on_ray = time.monotonic() - started
    assert res.returncode == 0, res.stdout + res.stderr
    started = time.monotonic()
    local = run_pslaunch(["--launcher", "local", *words], timeout=120, cwd=str(REPO))
    on_local = time.monotonic() - started
    assert local.returncode == 0, local.stderr
    print(f"digits -s {servers}: --launcher ray {on_ray:.1f} s, --launcher local {on_local:.1f} s")
    ray_acc, local_acc = _final_accuracies(res.stdout), _final_accuracies(local.stdout)
    assert sorted(ray_acc) == [0, 1] and ray_acc == local_acc, (ray_acc, local_acc)
    # the usual prefixes, each process named by its Ray node; spread: every node used, servers apart
    head, node = ray_cluster.node_ip("head"), ray_cluster.node_ip("node")
    processes = json.loads(summary.read_text())["processes"]
    placed = {p["name"].split("@")[0]: p["host"] for p in processes}
    # the runtime's counters came through (what the live table and --metrics-port show too)
    assert servers == "0" or all(p["pushed_bytes"] for p in processes if p["role"] == "worker"), processes
    assert set(placed.values()) == {head, node}, placed
    if servers == "2":
        assert placed["server.0"] != placed["server.1"], placed
    assert f"[worker.1@{placed['worker.1']}] worker 1 epoch 5 test_accuracy" in res.stdout
    events = json.loads(trace.read_text())
    assert len(events) > 1 and any(e.get("ph") == "X" for e in events), events[:3]  # more than the metadata
    _nothing_left(ray_cluster)


def test_sync_dst_dir_puts_the_working_directory_there_on_each_node_and_processes_start_in_it(ray_cluster, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "data.txt").write_text("shipped\n")
    (src / "where.py").write_text("import os\nprint('cwd', os.getcwd(), open('data.txt').read().strip())\n")
    env = ray_cluster.driver_env()
    env["PYTHONPATH"] = str(REPO)
    res = run_pslaunch(["--launcher", "ray", "-n", "2", "-s", "0", "--sync-dst-dir", str(dst), "where.py"], timeout=120,
                       cwd=str(src), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(f"cwd {dst} shipped") == 2, res.stdout
    assert sorted(os.listdir(dst)) == ["data.txt", "where.py"]
    _nothing_left(ray_cluster)


def test_a_working_directory_past_rays_limit_is_refused_before_anything_is_zipped(ray_cluster, tmp_path):
    (tmp_path / "blob.bin").write_bytes(os.urandom(300_000))
    (tmp_path / "w.py").write_text("print('never runs')\n")
    env = ray_cluster.driver_env()
    env.update(PYTHONPATH=str(REPO), RAY_max_grpc_message_size="100000")  # Ray's package limit, lowered to 100 kB
    res = run_pslaunch(["--launcher", "ray", "-n", "1", "-s", "0", "w.py"], timeout=60, cwd=str(tmp_path), env=env)
    assert res.returncode == 4, res.stdout + res.stderr
    assert (f"pslaunch: error: Ray would upload the working directory {tmp_path} to every node, and it holds 293.0 KiB "
            "after .gitignore, .rayignore and --ray-exclude (Ray's package limit is 97.7 KiB); the biggest: blob.bin "
            "293.0 KiB, w.py") in res.stderr, res.stderr
    assert "never runs" not in res.stdout and "Traceback" not in res.stderr
    _nothing_left(ray_cluster)


def test_a_data_set_in_the_working_directory_is_named_at_once_and_runs_once_left_out(ray_cluster, tmp_path):
    # 48 GB beside the code once went to Ray's zip for minutes and filled the disk; a Ray session
    # folder in the directory (its temp dir) is never uploaded at all
    with open(tmp_path / "dataset.bin", "wb") as fh:
        fh.truncate(48 << 30)  # sparse: no disk taken
    session = tmp_path / "raytmp" / "session_2026-12-06_00-00-00_000000_1"
    (session / "logs").mkdir(parents=True)
    (session / "sockets").mkdir()
    with open(session / "logs" / "raylet.out", "wb") as fh:
        fh.truncate(4 << 30)
    (tmp_path / "w.py").write_text("print('ran from', __import__('os').getcwd())\n")
    env = ray_cluster.driver_env()
    env["PYTHONPATH"] = str(REPO)
    started = time.monotonic()
    res = run_pslaunch(["--launcher", "ray", "-n", "1", "-s", "0", "w.py"], timeout=60, cwd=str(tmp_path), env=env)
    assert res.returncode == 4 and time.monotonic() - started < 30, res.stdout + res.stderr
    assert "holds 48.0 GiB after .gitignore, .rayignore and --ray-exclude" in res.stderr, res.stderr
    assert "the biggest: dataset.bin 48.0 GiB, w.py" in res.stderr and "raytmp" not in res.stderr
    res = run_pslaunch(["--launcher", "ray", "-n", "1", "-s", "0", "--ray-exclude", "*.bin", "-v", "w.py"], timeout=90,
                       cwd=str(tmp_path), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ran from" in res.stdout and "Ray's own folders left out: raytmp" in res.stderr
    _nothing_left(ray_cluster)


def test_a_raising_worker_is_the_root_cause_with_its_traceback(ray_cluster, marker):
    res = _ray(ray_cluster, ["-n", "2", "-s", "2", "--env", "RAISE_RANK:1", "--env", "RAISE_STEP:5", sys.executable,
                             helper("raise_at_step.py"), marker])
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"root cause: worker\.1@198\.18\.\d+\.\d+ \(worker rank 1 on \S+, pid \d+\) failed first: "
                     r"exit code 1", res.stderr), res.stderr
    assert re.search(r"\[worker\.1@\S+\] RuntimeError: worker 1 fails at step 5", res.stderr), res.stderr
    assert "pslaunch:   | RuntimeError: worker 1 fails at step 5" in res.stderr
    _nothing_left(ray_cluster, marker)


def test_the_job_key_is_in_no_command_line_environment_or_ray_log(ray_cluster, tmp_path, marker):
    # The test gives the key (so that it can look for it in Ray's files): on pslaunch's own command line,
    # the one command line that may hold it.
    key = secrets.token_hex(32)
    logs = tmp_path / "logs"
    proc = _started(ray_cluster, ["-n", "2", "-s", "1", "--log-dir", str(logs), "--env", f"PSLAUNCH_JOB_KEY:{key}",
                                  sys.executable, helper("key_witness.py"), marker], tmp_path)
    try:
        assert proc.wait(120) == 0, (tmp_path / "stderr").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    context = (tmp_path / "stdout").read_text() + (tmp_path / "stderr").read_text()
    for seen in ("HAS_KEY True", "KEY_VARIABLES_BEFORE_IMPORT ['PSLAUNCH_JOB_KEY_FD']", "IN_OWN_ENVIRON False",
                 "IN_A_CHILDS_ENVIRON False", "VISIBLE_TO_USER_CODE False", f"IN_A_COMMAND_LINE ['{proc.pid}']",
                 "IN_AN_ENVIRON []", "DONE"):
        assert context.count(seen) == 2, (seen, context)  # each worker's
    assert key not in context and not any(key.encode() in f.read_bytes() for f in logs.iterdir())
    assert ray_cluster.files_holding(key.encode()) == []  # Ray's logs and state on both nodes
    _nothing_left(ray_cluster, marker)


def test_a_placement_group_the_cluster_cannot_hold_is_an_error_naming_what_is_missing(ray_cluster):
    started = time.monotonic()  # --ray-timeout given: waited for (a cluster may grow), then named
    res = _ray(ray_cluster, ["-n", "4", "-s", "1", "--ray-worker-resources", '{"CPU": 1, "GPU": 1}', "--ray-timeout",
                             "2", "examples/train_mlp.py"], timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert ("pslaunch: error: Ray could not place the job's 6 bundles within --ray-timeout 2 s: needs 4 GPU, "
            "cluster has 0") in res.stderr, res.stderr
    assert time.monotonic() - started < 30
    _nothing_left(ray_cluster)


def test_without_ray_timeout_a_group_bigger_than_the_cluster_is_refused_at_once(ray_cluster):
    # 2 servers, 4 workers and the scheduler need 7 CPUs of a cluster of 6: no waiting the default 60 s
    started = time.monotonic()
    res = _ray(ray_cluster, ["-n", "4", "-s", "2", "examples/train_mlp.py"], timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert ("pslaunch: error: Ray cannot place the job's 7 bundles: needs 7 CPU, cluster has 6 (the cluster's own "
            "resources, so pslaunch does not wait; on a cluster that grows on demand give --ray-timeout S to wait "
            "for it)") in res.stderr, res.stderr
    assert time.monotonic() - started < 30
    _nothing_left(ray_cluster)


def test_ctrl_c_ends_the_job_and_leaves_no_process_actor_or_placement_group(ray_cluster, tmp_path, marker):
    proc = _started(ray_cluster, ["-n", "2", "-s", "2", "--env", "STEPS:100000", "--env", "STEP_SLEEP:0.02",
                                  sys.executable, helper("steps_worker.py"), marker], tmp_path)
    try:
        _wait_for_line(proc, tmp_path / "stdout", "step 20")
        interrupted = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130
        exited = time.monotonic() - interrupted
        assert wait_gone(marker, 10) == []
        gone = time.monotonic() - interrupted
        assert ray_cluster.left() == {"placement_groups": [], "actors": []}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"Ctrl-C: pslaunch exited after {exited:.2f} s, no process of the job left after {gone:.2f} s")
    assert "root cause: pslaunch got SIGINT" in (tmp_path / "stderr").read_text()


def test_timeout_ends_the_job_with_124_and_leaves_nothing(ray_cluster, marker):
    res = _ray(ray_cluster, ["-n", "2", "-s", "1", "--timeout", "5", "--env", "STEPS:100000", "--env", "STEP_SLEEP:0.02",
                             sys.executable, helper("steps_worker.py"), marker])
    assert res.returncode == 124, res.stdout + res.stderr
    assert "root cause: the job ran longer than --timeout 5 s" in res.stderr
    _nothing_left(ray_cluster, marker)


def test_ctrl_c_while_ray_cannot_place_the_group_ends_at_once_and_removes_it(ray_cluster, tmp_path):
    proc = _started(ray_cluster, ["-n", "2", "-s", "1", "--ray-worker-resources", '{"GPU": 1}', "--ray-timeout", "120",
                                  "examples/train_mlp.py"], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not ray_cluster.left()["placement_groups"]:  # connected, the group made and pending
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, f"no placement group after 60 s: {(tmp_path / 'stderr').read_text()}"
            time.sleep(0.1)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130, (tmp_path / "stderr").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert ray_cluster.left() == {"placement_groups": [], "actors": []}


def test_a_killed_server_restarts_the_job_which_resumes_to_the_uninterrupted_weights(ray_cluster, tmp_path):
    job = ["-n", "2", "-s", "2", "--env", "PSLAUNCH_BIGARRAY_BOUND:1000", "--timeout", "150"]
    plain, faulty = tmp_path / "plain", tmp_path / "faulty"
    plain.mkdir(), faulty.mkdir()
    res = run_pslaunch(["--launcher", "local", *job, "--checkpoint-dir", str(plain / "ckpt"), helper("resume_train.py"),
                        str(plain)], timeout=120)
    assert res.returncode == 0, res.stderr
    fault = ["--env", "FAULT:kill-server", "--env", "FAULT_RANK:0", "--env", "FAULT_STEP:23", "--env", "FAULT_SERVER:1",
             "--env", "COMMIT_WAIT:1"]
    res = _ray(ray_cluster, [*job, "--max-restarts", "1", "--checkpoint-dir", str(faulty / "ckpt"), *fault,
                             sys.executable, helper("resume_train.py"), str(faulty)])
    assert res.returncode == 0, res.stdout + res.stderr
    attempts = re.findall(r"^pslaunch: attempt (\d): (.*) -> (.*)$", res.stderr, re.M)
    assert [(n, a) for n, _, a in attempts] == [("1", "restarted the job (restart 1 of 1)"),
                                                 ("2", "none: the job succeeded")], res.stderr
    assert re.match(r"server\.\d@198\.18\.\d+\.\d+ \(server rank \d on \S+, pid \d+\) failed first: exit code 137",
                    attempts[0][1]), attempts
    with np.load(plain / "final.npz") as a, np.load(faulty / "final.npz") as b:
        assert {k: a[k].tobytes() for k in a.files} == {k: b[k].tobytes() for k in b.files}
    _nothing_left(ray_cluster, str(faulty))


def test_a_dist_sync_worker_killed_on_ray_is_replaced_in_place_with_the_uninterrupted_weights(ray_cluster, tmp_path):
    # --restart-scope worker: the replacement is a new actor with the worker's rank; the scheduler,
    # the servers and the other worker go on (tests/launcher/test_replacement.py has the local runs).
    # Before the raylet test below: the job's 5 bundles need both nodes
    job = ["-n", "2", "-s", "2", "--env", "PSLAUNCH_BIGARRAY_BOUND:1000", "--env", "STEPS:12", "--timeout", "100"]
    plain, killed = tmp_path / "plain", tmp_path / "killed"
    plain.mkdir(), killed.mkdir()
    res = run_pslaunch(["--launcher", "local", *job, sys.executable, helper("replace_sync.py"), str(plain)], timeout=120)
    assert res.returncode == 0, res.stderr
    res = _ray(ray_cluster, [*job, "--max-restarts", "2", "--restart-scope", "worker", "--env", "KILLS:1:4:push,0:7:pulled",
                             sys.executable, helper("replace_sync.py"), str(killed)], timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr.count("the other processes go on") == 2, res.stderr
    with np.load(plain / "weights.npz") as a, np.load(killed / "weights.npz") as b:
        assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files), "the weights differ"
    _nothing_left(ray_cluster, str(killed))


def test_a_node_whose_raylet_is_killed_is_the_root_cause_with_exit_255(ray_cluster, tmp_path, marker):
    proc = _started(ray_cluster, ["-n", "2", "-s", "2", "--env", "STEPS:100000", "--env", "STEP_SLEEP:0.02",
                                  sys.executable, helper("steps_worker.py"), marker], tmp_path)
    try:
        _wait_for_line(proc, tmp_path / "stdout", "step 20")
        ray_cluster.kill_raylet("node")
        killed = time.monotonic()
        assert proc.wait(60) == 255, (tmp_path / "stderr").read_text()
        print(f"killed raylet: pslaunch exited 255 after {time.monotonic() - killed:.2f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    node = ray_cluster.node_ip("node")
    err = (tmp_path / "stderr").read_text()
    assert re.search(rf"root cause: host {re.escape(node)} lost \(its Ray node {re.escape(node)} left the cluster\): "
                     rf"pslaunch could not reach \S+@{re.escape(node)}", err), err
    assert "Raylet is terminated" not in err + (tmp_path / "stdout").read_text()  # Ray's own report stays out
    _nothing_left(ray_cluster, marker)
