"""Per-node agents on a simulated cluster without ssh: three network namespaces (``testkit.netns``,
addresses in 198.18.0.0/15, unreachable from the machine's real routes), one pslaunch agent in each,
no sshd anywhere. Each namespace is a Kubernetes pod: it resolves the headless Service's names
(``train-0.pslaunch`` ...) through a hosts file of its own (``ip netns exec`` mounts
``/etc/netns/NAME/hosts`` over ``/etc/hosts``), and the recipe of docs/kubernetes.md runs as written.

Marked ``netns`` (root and iproute2; ``scripts/test.sh`` runs them with the rest).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from testkit.launcher import PSLAUNCH, REPO, helper, processes_with, run_pslaunch, wait_gone
from testkit.launcher.agents import AgentJob, Pods, write_key

pytestmark = pytest.mark.netns

PORT = 29400
LINK_TIMEOUT = 4


@pytest.fixture(scope="module")
def pods():
    from testkit.netns import NetnsCluster, usable

    why = usable()
    if why is not None:
        pytest.skip(why)
    with NetnsCluster(nics=("eth0", "eth0", "eth0")) as net:
        made = Pods(net, PORT)
        try:
            yield made
        finally:
            made.close()


@pytest.fixture
def key_env(tmp_path):
    return {**os.environ, "PSLAUNCH_JOB_KEY_FILE": str(write_key(tmp_path / "job.key"))}


def _pods_job(pods, tmp_path, args, env, marker=None) -> AgentJob:
    return AgentJob(tmp_path, 3, pods.endpoint, args, env=env, prefix=pods.prefix, marker=marker)


def _manifest() -> dict:
    yaml = pytest.importorskip("yaml", reason="the test extra's pyyaml reads the manifest")
    text = (REPO / "docs" / "kubernetes.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    job = next(d for d in yaml.safe_load_all(block) if d["kind"] == "Job")
    return job


def _accuracies(output: str) -> dict[int, list[float]]:
    curves: dict[int, list[float]] = {}
    for rank, acc in re.findall(r"worker (\d+) epoch \d+ test_accuracy ([\d.]+)", output):
        curves.setdefault(int(rank), []).append(float(acc))
    return curves


def test_the_kubernetes_recipe_runs_in_namespaces_one_per_pod(pods, tmp_path):
    job = _manifest()
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == 3
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "pslaunch"
    (container,) = pod["containers"]
    command = container["command"]
    assert command[0] == "pslaunch"
    env = {item["name"]: item["value"] for item in container["env"]}
    # What Kubernetes does, done here: the Secret's file (another path), and this checkout's pslaunch.
    mount = container["volumeMounts"][0]["mountPath"]
    assert env["PSLAUNCH_JOB_KEY_FILE"].startswith(mount + "/")
    env["PSLAUNCH_JOB_KEY_FILE"] = str(write_key(tmp_path / "secret-key"))
    assert command[command.index("--rdzv-endpoint") + 1] == pods.endpoint
    base = {**os.environ, **env}
    with AgentJob(tmp_path, 3, pods.endpoint, [], env=base, prefix=pods.prefix) as agents:
        for rank in (2, 1, 0):  # pods start in any order: node 0 last
            agents.start(rank, env={"JOB_COMPLETION_INDEX": str(rank)}, argv=pods.prefix(rank) + PSLAUNCH + command[1:])
            time.sleep(0.5)
        results = agents.wait(180)
    assert {r: res.returncode for r, res in results.items()} == {0: 0, 1: 0, 2: 0}, agents.report()
    curves = _accuracies(results[0].stdout)
    assert sorted(curves) == [0, 1, 2], results[0].stdout
    # the same training with the local launcher: the same accuracy
    words = command[command.index("-n"):]
    local = run_pslaunch(["--launcher", "local", *words], timeout=180, cwd=str(REPO))
    assert local.returncode == 0, local.stderr
    alone = _accuracies(local.stdout)
    for rank, curve in curves.items():
        assert abs(curve[-1] - alone[rank][-1]) <= 0.01, (curve, alone)
        assert curve[-1] >= 0.9, curve
    # each pod's log holds its own processes' lines; pod 0's every process's
    assert "[worker.1@node1] worker 1 epoch" in results[1].stdout and "@node2]" not in results[1].stdout
    assert "[worker.2@node2] worker 2 epoch" in results[0].stdout


def test_a_worker_on_node_2_raising_is_every_agents_root_cause_and_exit_code(pods, tmp_path, key_env, marker):
    out = tmp_path / "out"
    out.mkdir()
    args = ["-n", "3", "-s", "3", "--timeout", "60", "--env", "FAULT:raise", "--env", "FAULT_RANK:2", "--env",
            "FAULT_STEP:5", sys.executable, helper("resume_train.py"), str(out), marker]
    with _pods_job(pods, tmp_path, args, key_env, marker) as job:
        job.start_all()
        results = job.wait(90)
    for rank, result in results.items():
        assert result.returncode == 1, job.report()
        assert "root cause: worker.2@node2 (worker rank 2 on node2" in result.stderr, job.report()
    assert "[worker.2@node2] RuntimeError: worker 2 fails at step 5" in results[0].stderr
    assert wait_gone(marker, 10) == []


def test_node_1s_link_down_mid_job_is_named_on_both_sides_and_nothing_is_left_once_it_is_back(
        pods, tmp_path, key_env, marker):
    args = ["-n", "3", "-s", "3", "--link-timeout", str(LINK_TIMEOUT), "--stop-grace", "2", "--timeout", "90",
            "--env", "STEPS:100000", "--env", "STEP_SLEEP:0.02", sys.executable, helper("steps_worker.py"), marker]
    with _pods_job(pods, tmp_path, args, key_env, marker) as job:
        job.start_all()
        job.wait_for(0, "[worker.0@node0] step 10", 60)
        pods.net.cut(pods.hosts[1])
        cut = time.monotonic()
        try:
            results = job.wait(60)
            ended = time.monotonic() - cut
        finally:
            pods.net.restore(pods.hosts[1])
    assert {r: res.returncode for r, res in results.items()} == {0: 255, 1: 255, 2: 255}, job.report()
    lost = (f"root cause: host node1 lost (no answer for {LINK_TIMEOUT} s): pslaunch could not reach "
            "server.1@node1, worker.1@node1")
    assert lost in results[0].stderr and lost in results[2].stderr, job.report()
    assert (f"root cause: lost node 0 at {pods.endpoint} (no word for {LINK_TIMEOUT} s); stopped node1's processes"
            in results[1].stderr), job.report()
    assert ended < 3 * LINK_TIMEOUT + 15, ended  # a bound against a hang, not a measurement
    assert wait_gone(marker, 15) == []


def test_an_agent_with_a_wrong_key_is_refused_on_both_sides(pods, tmp_path, key_env):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    with _pods_job(pods, tmp_path, ["-n", "2", "-s", "1", str(script)], key_env) as job:
        job.start(0, extra=["--rdzv-timeout", "6"])
        job.start(1, env={"PSLAUNCH_JOB_KEY_FILE": str(write_key(tmp_path / "wrong.key"))})
        results = job.wait(40, [1, 0])
    assert results[1].returncode == 3, job.report()
    assert f"node 0 at {pods.endpoint} does not hold this agent's job key" in results[1].stderr
    assert results[0].returncode == 3, job.report()
    assert f"refused an agent at {pods.net.address('h2')} (node rank 1): wrong job key" in results[0].stderr
    assert f"node1, node2 did not join node 0 at {pods.endpoint} within --rdzv-timeout 6 s" in results[0].stderr


def _weights(out: Path) -> dict[str, bytes]:
    with np.load(out / "final.npz") as final:
        return {k: final[k].tobytes() for k in final.files}


def test_a_restart_after_a_killed_server_ends_with_the_weights_of_an_uninterrupted_run(pods, tmp_path, key_env, marker):
    job_args = ["-n", "3", "-s", "3", "--env", "PSLAUNCH_BIGARRAY_BOUND:1000", "--env", "STEPS:40", "--timeout", "120"]
    plain = tmp_path / "plain"
    plain.mkdir()
    res = run_pslaunch(["--launcher", "local", *job_args, "--checkpoint-dir", str(plain / "ckpt"), sys.executable,
                        helper("resume_train.py"), str(plain), marker], timeout=150)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    out.mkdir()
    faulty = [*job_args, "--max-restarts", "1", "--checkpoint-dir", str(out / "ckpt"), "--env", "FAULT:kill-server",
              "--env", "FAULT_SERVER:1", "--env", "FAULT_RANK:0", "--env", "FAULT_STEP:22", sys.executable,
              helper("resume_train.py"), str(out), marker]
    with _pods_job(pods, tmp_path, faulty, key_env, marker) as job:
        job.start_all()
        results = job.wait(150)
    assert {r: res.returncode for r, res in results.items()} == {0: 0, 1: 0, 2: 0}, job.report()
    assert "restarting the job (restart 1 of 1" in results[0].stderr
    assert _weights(out) == _weights(plain)
    step, _ = (out / "resumed.1.0").read_text().split()
    assert int(step) == 20  # the last checkpoint before the fault
    assert wait_gone(marker, 10) == []
    assert not [line for line in processes_with(str(out))], "processes of the job were left running"


def test_the_pods_resolve_the_services_names_through_their_hosts_files(pods):
    res = subprocess.run(pods.prefix(1) + [sys.executable, "-c", "import socket; print(socket.gethostbyname("
                                           "'train-0.pslaunch'))"], capture_output=True, text=True, timeout=30)
    assert res.stdout.strip() == pods.net.address("h1"), res.stderr
