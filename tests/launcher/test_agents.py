"""Per-node agents on one machine: ``pslaunch --nnodes N --node-rank R --rdzv-endpoint 127.0.0.1:PORT``
started once per node as a user would, each a real process, the job's processes real children of
the agents, node 0's rendezvous a real TCP port. The same on separate network namespaces, with the
Kubernetes recipe's command: ``test_agents_netns.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from pscontract import free_port
from testkit.launcher import REPO, helper, run_pslaunch, wait_gone
from testkit.launcher.agents import AgentJob, write_key


@pytest.fixture
def key_env(tmp_path):
    """The environment of every node: the job key in a file, as a mounted Secret."""
    return {**os.environ, "PSLAUNCH_JOB_KEY_FILE": str(write_key(tmp_path / "job.key"))}


def _endpoint() -> str:
    """A rendezvous endpoint whose port and the next (node 0's scheduler listens at PORT + 1) are free."""
    for _ in range(64):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue  # the scheduler's port is taken: another pair
        return f"127.0.0.1:{port}"
    raise AssertionError("no two free ports in a row on 127.0.0.1")


def _steps(marker: str, steps: int = 30) -> list[str]:
    return ["--env", f"STEPS:{steps}", "--env", "STEP_SLEEP:0.02", sys.executable, helper("steps_worker.py"), marker]


def test_three_agents_started_node_0_last_form_one_keyed_job_whose_table_node_0_prints(tmp_path, key_env, marker):
    endpoint = _endpoint()
    summary = tmp_path / "summary.json"
    with AgentJob(tmp_path, 3, endpoint, ["-n", "3", "-s", "2", "--timeout", "60", *_steps(marker)], env=key_env,
                  marker=marker) as job:
        job.start(2)
        job.start(1)
        time.sleep(1.0)  # the agents knock at a port nobody listens at yet
        job.start(0, extra=["--summary-json", str(summary), "--timeline", str(tmp_path / "trace.json")])
        # a stranger's bytes at the rendezvous port are refused and change nothing
        host, port = endpoint.rsplit(":", 1)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=2) as stranger:
                    stranger.sendall(b"\x00\x00\x00\x05" + bytes(32) + b"hello" + os.urandom(64))
                    stranger.recv(100)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        results = job.wait(60)
    assert {rank: r.returncode for rank, r in results.items()} == {0: 0, 1: 0, 2: 0}, job.report()
    node0 = results[0].stdout + results[0].stderr
    assert "[worker.0@node0] done 3" in node0
    assert "refused an agent at 127.0.0.1" in node0
    for name in ("scheduler.0@node0", "server.0@node0", "server.1@node1", "worker.1@node1", "worker.2@node2"):
        assert f"[{name}]" in node0 or name.split("@")[1] in node0
    rows = {(p["role"], p["rank"]): p for p in json.loads(summary.read_text())["processes"]}
    assert {(role, rank): rows[(role, rank)]["host"] for role, rank in rows} == {
        ("scheduler", 0): "node0", ("server", 0): "node0", ("server", 1): "node1",
        ("worker", 0): "node0", ("worker", 1): "node1", ("worker", 2): "node2"}
    assert "@node0]" not in results[1].stdout + results[1].stderr  # an agent shows its own processes' lines only
    # node 0 sees every node's processes: their counters in the summary, their events in the timeline
    assert rows[("worker", 2)]["rounds"] == 30 and rows[("worker", 1)]["pushed_bytes"] > 0, rows
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    named = {e["args"]["name"].split(" (")[0] for e in events if e.get("name") == "process_name"}
    assert {"worker 1", "worker 2", "server 1"} <= named, named
    assert wait_gone(marker, 10) == []


def test_a_worker_failing_on_node_2_is_every_agents_root_cause_and_exit_code(tmp_path, key_env, marker):
    out = tmp_path / "out"
    out.mkdir()
    args = ["-n", "3", "-s", "2", "--timeout", "60", "--env", "FAULT:raise", "--env", "FAULT_RANK:2", "--env",
            "FAULT_STEP:3", sys.executable, helper("resume_train.py"), str(out), marker]
    with AgentJob(tmp_path, 3, _endpoint(), args, env=key_env, marker=marker) as job:
        job.start_all()
        results = job.wait(60)
    cause = "root cause: worker.2@node2 (worker rank 2 on node2"
    for rank, result in results.items():
        assert result.returncode == 1, job.report()
        assert cause in result.stderr, (rank, job.report())
    # its traceback shows on its own node and on node 0, with the usual prefix, not on node 1
    raised = "[worker.2@node2] RuntimeError: worker 2 fails at step 3"
    assert raised in results[2].stderr and raised in results[0].stderr and raised not in results[1].stderr
    assert wait_gone(marker, 10) == []


def test_agents_with_a_wrong_key_another_job_or_another_command_are_refused_naming_why(tmp_path, key_env):
    endpoint = _endpoint()
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    with AgentJob(tmp_path, 2, endpoint, ["-n", "2", "-s", "1", str(script)], env=key_env) as job:
        job.start(0, extra=["--rdzv-timeout", "8"])
        wrong = {"PSLAUNCH_JOB_KEY_FILE": str(write_key(tmp_path / "other.key"))}
        job.start(1, env=wrong)
        refused_key = job.wait(30, [1])[1]
        job.start(1, extra=["--job-id", "another-job"])
        refused_job = job.wait(30, [1])[1]
        job.start(1, argv=job.argv(1)[:-len(job.args)] + ["-n", "4", "-s", "1", str(script)])
        refused_command = job.wait(30, [1])[1]
        node0 = job.wait(30, [0])[0]
    assert refused_key.returncode == 3, refused_key.stderr
    assert f"node 0 at {endpoint} does not hold this agent's job key" in refused_key.stderr
    assert refused_job.returncode == 3, refused_job.stderr
    assert "refused this agent: it belongs to job 'another-job', node 0 runs job 'job-" in refused_job.stderr
    assert refused_command.returncode == 3, refused_command.stderr
    # said on node 1: its own value first, named by node (once "there" and "here", from node 0's side)
    assert "refused this agent: its command differs from node 0's: -n 4 on node1, 2 on node 0" in refused_command.stderr
    assert node0.returncode == 3, node0.stderr
    assert "refused an agent at 127.0.0.1 (node rank 1): wrong job key" in node0.stderr
    assert f"node1 did not join node 0 at {endpoint} within --rdzv-timeout 8 s; refused meanwhile:" in node0.stderr


@contextmanager
def _stepping(tmp_path, key_env, marker, endpoint=None):
    """Three agents running a long kvcore job, once its worker 0 stepped ten times."""
    with AgentJob(tmp_path, 3, endpoint or _endpoint(), ["-n", "3", "-s", "2", "--timeout", "60",
                                                        *_steps(marker, 100000)], env=key_env, marker=marker) as job:
        job.start_all()
        job.wait_for(0, "[worker.0@node0] step 10", 30)
        yield job


@pytest.mark.parametrize("node", [2, 0], ids=["on-an-agent", "on-node-0"])
def test_ctrl_c_on_any_node_ends_the_whole_job_on_every_node(tmp_path, key_env, marker, node):
    with _stepping(tmp_path, key_env, marker) as job:
        job.signal(node, signal.SIGINT)
        results = job.wait(30)
    assert {r: res.returncode for r, res in results.items()} == {0: 130, 1: 130, 2: 130}, job.report()
    for rank, result in results.items():
        said = "pslaunch got SIGINT" if rank == node == 0 else f"pslaunch on node{node} got SIGINT"
        assert f"root cause: {said}" in result.stderr, (rank, job.report())
    assert wait_gone(marker, 10) == []


def test_agents_that_lose_node_0_stop_their_processes_and_exit_255_naming_it(tmp_path, key_env, marker):
    endpoint = _endpoint()
    with _stepping(tmp_path, key_env, marker, endpoint) as job:
        os.killpg(job.procs[0].pid, signal.SIGKILL)  # node 0's pslaunch and its processes, at once
        results = job.wait(30, [1, 2])
    for rank, result in results.items():
        assert result.returncode == 255, job.report()
        assert f"root cause: lost node 0 at {endpoint} (node 0 closed the connection); stopped node{rank}'s " \
               "processes" in result.stderr, job.report()
    assert wait_gone(marker, 15) == []


@pytest.mark.parametrize(("env", "shown"), [({"PSLAUNCH_NODE_RANK": "1"}, 1), ({"JOB_COMPLETION_INDEX": "2"}, 2),
                                            ({"PSLAUNCH_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "2"}, 1)])
def test_the_node_rank_comes_from_the_environment_and_dry_run_shows_that_nodes_share(tmp_path, key_env, env, shown):
    script = tmp_path / "train.py"
    script.write_text("")
    res = run_pslaunch(["--nnodes", "3", "--rdzv-endpoint", "train-0.pslaunch:29400", "-n", "3", "-s", "2",
                        "--dry-run", str(script)], env={**key_env, **env}, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    names = sorted(line.split()[0] for line in res.stdout.splitlines() if "(local rank" in line)
    expected = {1: ["server.1@node1", "worker.1@node1"], 2: ["worker.2@node2"]}[shown]
    assert names == expected, res.stdout
    assert f"agents: node {shown} of 3: the processes above are this node's share of the job's 6" in res.stdout
    assert "DMLC_PS_ROOT_URI=train-0.pslaunch DMLC_PS_ROOT_PORT=29401" in res.stdout


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--nnodes", "3", "--rdzv-endpoint", "h:29400"], {}, "this node's rank is not given: --node-rank R, or "
     "PSLAUNCH_NODE_RANK, or Kubernetes' JOB_COMPLETION_INDEX"),
    (["--nnodes", "3", "--rdzv-endpoint", "h:29400"], {"JOB_COMPLETION_INDEX": "x1"},
     "JOB_COMPLETION_INDEX='x1' is not a node rank"),
    (["--nnodes", "3", "--node-rank", "3", "--rdzv-endpoint", "h:29400"], {}, "--node-rank 3 is not a node of "
     "--nnodes 3: ranks are 0..2"),
    (["--nnodes", "2", "--node-rank", "1"], {}, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h"], {}, "--rdzv-endpoint 'h': expected HOST:PORT"),
    (["--node-rank", "1"], {}, "--node-rank is an option of the per-node agents: give --nnodes N too"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "--launcher", "ssh"], {},
     "it does not combine with --launcher ssh"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "--scheduler-host", "x"], {},
     "--scheduler-host is not an option of --launcher agents: node 0 runs the scheduler"),
])
def test_agent_options_that_cannot_work_are_refused_naming_the_value(tmp_path, key_env, args, env, message):
    res = run_pslaunch([*args, "-n", "2", "--dry-run", "train.py"], env={**key_env, **env})
    assert res.returncode == 2, res.stderr
    assert message in res.stderr


def test_agents_across_machines_without_a_key_are_refused_before_anything_starts():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSLAUNCH_JOB_KEY")}
    res = run_pslaunch(["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "10.1.2.3:29400", "-n", "2",
                        "--dry-run", "train.py"], env=env)
    assert res.returncode == 2, res.stderr
    assert "--nnodes 2 across machines needs the job's key on every node: PSLAUNCH_JOB_KEY_FILE" in res.stderr


def test_an_agent_from_python_returns_its_nodes_run_result(tmp_path, key_env, marker):
    endpoint = _endpoint()
    code = ("import json, sys; from launcher import launch\n"
            f"r = launch({_steps(marker)[4:]!r}, num_workers=2, num_servers=2, nnodes=2, node_rank=1, "
            f"rdzv_endpoint={endpoint!r}, env={{'STEPS': '30', 'STEP_SLEEP': '0.02'}})\n"
            "print(json.dumps([r.exit_code, sorted(p.name for p in r.processes)]))\n")
    with AgentJob(tmp_path, 2, endpoint, ["-n", "2", "-s", "2", "--timeout", "60", *_steps(marker)], env=key_env,
                  marker=marker) as job:
        job.start(0)
        job.start(1, argv=[sys.executable, "-c", code])
        results = job.wait(60)
    assert results[0].returncode == 0, job.report()
    assert json.loads(results[1].stdout.strip().splitlines()[-1]) == [0, ["server.1@node1", "worker.1@node1"]]


def test_launching_without_ssh_in_the_readme_names_the_flags_docs_launcher_md_describes():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Launching without ssh", 1)[1].split("\n## ", 1)[0]
    for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint", "PSLAUNCH_JOB_KEY_FILE"):
        assert flag in section
    doc = (REPO / "docs" / "launcher.md").read_text()
    for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-timeout", "PSLAUNCH_NODE_RANK",
                 "JOB_COMPLETION_INDEX"):
        assert flag in doc
    assert subprocess.run([sys.executable, "-m", "launcher.cli", "--help"], capture_output=True, text=True,
                          cwd=str(REPO)).stdout.count("--rdzv-") == 2


def test_an_agent_killed_outright_is_its_nodes_loss_and_its_watchdog_stops_its_processes(tmp_path, key_env, marker):
    with _stepping(tmp_path, key_env, marker) as job:
        job.signal(1, signal.SIGKILL)  # node 1's pslaunch alone: its processes are left to its watchdog
        results = job.wait(30, [0, 2])
    for rank, result in results.items():
        assert result.returncode == 255, job.report()
        assert ("root cause: host node1 lost (its agent's connection ended): pslaunch could not reach server.1@node1, "
                "worker.1@node1") in result.stderr, job.report()
    assert wait_gone(marker, 15) == []


def test_restart_scope_worker_restarts_a_failed_worker_alone_on_its_node(tmp_path, key_env):
    out = tmp_path / "out"
    out.mkdir()
    args = ["-n", "2", "-s", "2", "--max-restarts", "1", "--restart-scope", "worker", "--allow-restart-from-scratch",
            "--timeout", "120", sys.executable, helper("rejoin_async.py"), str(out)]
    with AgentJob(tmp_path, 2, _endpoint(), args, env=key_env, marker=str(out)) as job:
        job.start_all()
        results = job.wait(150)
    assert {r: res.returncode for r, res in results.items()} == {0: 0, 1: 0}, job.report()
    done, total, expected, _ = (out / "worker0.txt").read_text().split()
    assert total == expected and int(done) > 0
    assert "restarting it alone (restart 1 of 1, PSLAUNCH_RESTART_COUNT=1); the other processes go on" in \
        results[0].stderr
    assert wait_gone(str(out), 10) == []


def test_a_stall_past_the_stall_timeout_names_a_worker_on_another_node_with_the_stack_its_agent_asked_for(
        tmp_path, key_env, marker):
    out = tmp_path / "out"
    out.mkdir()
    # worker 1 (on node 1) sleeps 100 s before its pushes of step 2; marker in argv: the leftover check finds it
    args = ["-n", "2", "-s", "2", "--timeout", "60", "--stall-warn", "1", "--stall-timeout", "3", "--env",
            "PSLAUNCH_BIGARRAY_BOUND:1000", "--env", "STEPS:4", "--env", "STALL:1:2:compute:100", sys.executable,
            helper("replace_sync.py"), str(out), marker]
    with AgentJob(tmp_path, 2, _endpoint(), args, env=key_env, marker=marker) as job:
        job.start_all()
        results = job.wait(60)
    assert {rank: r.returncode for rank, r in results.items()} == {0: 86, 1: 86}, job.report()
    assert re.search(r"root cause: server \d: stalled: round 3 of key .* worker\.1@node1 \(worker rank 1 on node1.*\) "
                     r"is in maybe_die \(replace_sync\.py:\d+\)", results[0].stderr), job.report()
    assert re.search(r'pslaunch:   \| File ".*replace_sync\.py", line \d+ in maybe_die', results[0].stderr), job.report()
    assert wait_gone(marker, 10) == []


def test_an_elastic_jobs_worker_on_another_node_leaves_at_a_step_boundary_and_the_job_goes_on(tmp_path, key_env, marker):
    out = tmp_path / "out"
    out.mkdir()
    # -n 2:3 over 2 nodes; worker 2 sends itself SIGTERM after step 1: step 2 is its last push
    args = ["-n", "2:3", "-s", "1", "--timeout", "60", "--env", "STEPS:6", "--env", "LEAVE:2:1", sys.executable,
            helper("elastic_sum.py"), str(out), marker]
    with AgentJob(tmp_path, 2, _endpoint(), args, env=key_env, marker=marker) as job:
        job.start_all()
        results = job.wait(60)
    assert {rank: r.returncode for rank, r in results.items()} == {0: 0, 1: 0}, job.report()
    values = [float(line.split()[3]) for line in (out / "steps.0.txt").read_text().splitlines() if len(line.split()) == 4]
    assert values == [float(sum(r + 1 for r in ({0, 1, 2} if s <= 2 else {0, 1})) * (s + 1)) for s in range(6)], values
    assert "worker 2 left the job at a step boundary (SIGTERM); 2 workers go on" in job.report()
    assert wait_gone(marker, 10) == []


def test_nodes_join_a_running_elastic_job_and_a_drained_node_leaves_it_while_the_job_goes_on(tmp_path, key_env, marker):
    # --nnodes 1:3 with -n 1:3: node 0 forms the job alone (one worker per node); node 1 and then node 2
    # join later and their workers join the running job; node 2's agent then gets SIGTERM (a pod
    # deleted): its worker leaves at its next step boundary and the agent exits 0; every round is exact
    out = tmp_path / "out"
    out.mkdir()
    args = ["-n", "1:3", "-s", "1", "--timeout", "90", "--env", "STEPS:90", "--env", "STEP_SLEEP:0.05",
            sys.executable, helper("elastic_join.py"), str(out), marker]

    def rows() -> list[list[str]]:
        return [line.split() for path in out.glob("steps.*.txt") for line in path.read_text().splitlines()]

    def steps_of() -> dict[int, set[int]]:
        got: dict[int, set[int]] = {}
        for row in rows():
            if len(row) == 5:
                got.setdefault(int(row[1]), set()).add(int(row[0]))
        return got

    def wait_until(predicate, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, job.report()
            time.sleep(0.05)

    with AgentJob(tmp_path, "1:3", _endpoint(), args, env=key_env, marker=marker) as job:
        job.start(0)
        wait_until(lambda: len(steps_of()) >= 4)
        job.start(1)
        wait_until(lambda: any(len(m) == 2 for m in steps_of().values()))
        job.start(2)
        wait_until(lambda: any(len(m) == 3 for m in steps_of().values()))
        grown = max(steps_of())
        wait_until(lambda: max(steps_of()) >= grown + 4)
        job.signal(2, signal.SIGTERM)
        left = job.wait(60, ranks=[2])
        results = job.wait(90)
    assert {rank: r.returncode for rank, r in results.items()} == {0: 0, 1: 0, 2: 0}, job.report()
    assert "node2 leaves the elastic job; its workers leave at their next step boundary" in left[2].stderr, job.report()
    got = steps_of()
    sizes = [len(got[s]) for s in sorted(got)]
    assert sorted(got) == list(range(90)) and sizes[0] == 1 and 3 in sizes and sizes[-1] == 2, sizes
    for row in rows():
        if len(row) == 5:
            step, count, value = int(row[1]), int(row[2]), float(row[3])
            assert count == len(got[step]) and value == sum(r + 1 for r in got[step]) * (step + 1), (row, got[step])
    report = job.report()
    assert "the agents (--nnodes 1:3)): starting worker.1@node1 to join the job" in report, report
    assert wait_gone(marker, 10) == []
