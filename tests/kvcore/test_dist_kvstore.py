"""The distributed KVStore end to end: real scheduler, server and worker processes on 127.0.0.1.

The store's semantics (rounds, optimizers, rows, key lists, handles, dtypes) run the same worker
scripts inside one process (``run_inproc``: the real nodes on threads, ``kvcore.runtime.use``), in
milliseconds; what needs processes (the same-host paths, crashes, signals, the contract) runs them.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import pytest
import zmq
from kvcore_testkit import DEVICE_KINDS, run_inproc_ok, run_job_ok

from psnode.env import EXIT_PEER_FAILED
from psnode.node.protocol import Cmd, pack_header
from testkit import LocalJob, wait_catching

SCRIPTS = Path(__file__).parent / "dist_scripts"
SMALL_BOUND = {"PSLAUNCH_BIGARRAY_BOUND": "100000"}  # 1200x1200 keys are split across the servers


def script(name: str, *args: str) -> list[str]:
    return [str(SCRIPTS / name), *args]


def run_ok(name: str, workers: int, servers: int, env: dict | None = None, args: tuple = (), timeout: float = 60):
    return run_job_ok(script(name, *args), workers, servers, {**SMALL_BOUND, **(env or {})}, timeout)


def run_inproc(name: str, workers: int, servers: int, settings: dict | None = None, args: tuple = ()) -> dict:
    return run_inproc_ok(script(name, *args), workers, servers, {**SMALL_BOUND, **(settings or {})})


def wait_for_line(job: LocalJob, role: str, index: int | None, pattern: str, timeout: float = 30) -> re.Match:
    return job.wait_for_line(role, index, pattern, timeout)


@pytest.mark.parametrize("same_host", ["shm", "ipc", "tcp"])
def test_dist_sync_sums_are_exact_for_small_split_and_listed_keys_and_pushpull(same_host):
    results = run_ok("sums.py", workers=3, servers=2, env={"PSLAUNCH_SAME_HOST": same_host})
    assert all(r.returncode == 0 for r in results if r.role in ("scheduler", "server"))


@pytest.mark.unit
def test_test_optimizer_on_the_servers_gives_exact_values_every_round():
    run_inproc("optimizer_rounds.py", workers=3, servers=2)


@pytest.mark.unit
def test_dist_async_needs_an_optimizer_then_applies_every_push_exactly_once():
    run_inproc("async_rounds.py", workers=2, servers=2)


@pytest.mark.unit
def test_row_sparse_pull_returns_exactly_the_asked_rows_of_small_and_split_keys():
    run_inproc("rows.py", workers=3, servers=2)


@pytest.mark.unit
def test_barrier_holds_every_worker_until_the_last_arrives(tmp_path):
    run_inproc("barrier_order.py", workers=3, servers=1, args=(str(tmp_path / "marker"),))


def test_a_worker_that_crashes_makes_every_other_node_fail_naming_it():
    with LocalJob(3, 2, worker=script("crash.py")) as job:
        results = job.wait(60)
    by_code = {}
    for r in results:
        by_code.setdefault(r.returncode, []).append(r)
    assert len(by_code.get(3, [])) == 2, "\n".join(map(str, results))  # the two survivors saw NodeDiedError
    for r in by_code[3]:
        assert "DIED worker 1" in r.output and "RuntimeError: boom in worker 1" in r.output, r
    for r in results:
        if r.role in ("scheduler", "server"):
            assert r.returncode == EXIT_PEER_FAILED and "ended because a peer failed: worker 1 on 127.0.0.1" in r.output, r


def test_a_worker_that_does_not_catch_a_peer_failure_exits_75_with_one_line_naming_the_peer():
    ranks = [{"DMLC_WORKER_ID": str(i)} for i in range(3)]
    with LocalJob(3, 1, worker=script("uncaught_peer_failure.py"), worker_env=ranks) as job:
        results = job.wait(60)
    workers = {r.index: r for r in results if r.role == "worker"}
    failing = workers.pop(1)
    assert failing.returncode == 1 and "RuntimeError: boom in worker 1" in failing.output, failing
    for r in workers.values():
        assert r.returncode == EXIT_PEER_FAILED, r
        assert re.search(r"^psnode worker \d \(pid \d+\): ended because a peer failed: worker 1 on 127\.0\.0\.1:\d+ "
                         r"failed: RuntimeError: boom in worker 1$", r.output, re.M), r
        assert "Traceback" not in r.output and f"ATEXIT {r.index}" in r.output, r


def test_bundled_nodes_end_0_on_sigusr1_and_75_on_sigterm_naming_the_signal():
    import signal

    with LocalJob(1, 1, start_servers=1) as job:
        for role in ("server", "scheduler"):  # waiting for the worker to register, handling both signals
            wait_catching(job.of(role), [signal.SIGTERM, signal.SIGUSR1])
        job.of("server").send_signal(signal.SIGTERM)
        job.of("scheduler").send_signal(signal.SIGUSR1)
        results = {r.role: r for r in job.wait(20)}
    assert results["scheduler"].returncode == 0 and results["scheduler"].output == "", results["scheduler"]
    server = results["server"]
    assert server.returncode == EXIT_PEER_FAILED, server
    assert re.search(r"^psnode server \(pid \d+\): stopped by SIGTERM: the job is being torn down$", server.output, re.M), server


@pytest.mark.parametrize("size, path", [(8, {}), (1 << 19, {"PSLAUNCH_SAME_HOST": "tcp"})],
                         ids=["small keys", "2 MiB keys on data lanes"])
def test_killing_a_server_makes_every_worker_fail_within_the_heartbeat_timeout(size, path):
    env = {"PS_HEARTBEAT_INTERVAL": "0.2", "PS_HEARTBEAT_TIMEOUT": "1.5", **path}
    with LocalJob(2, 2, worker=script("loop_until_failure.py", str(size)), env=env) as job:
        for i in range(2):
            wait_for_line(job, "worker", i, r"^READY")  # after a few rounds
        job.of("server", 1).kill()
        results = job.wait(20)
    for r in results:
        if r.role == "worker":
            match = re.search(r"^DIED (\w+) (\d+) ([\d.]+) (.*)$", r.output, re.M)
            assert r.returncode == 3 and match, r
            assert match.group(1) == "server" and "no heartbeat" in match.group(4) and "127.0.0.1" in match.group(4), r
            assert float(match.group(3)) < 10 * 1.5, r  # named within ten heartbeat timeouts: a liveness deadline
        elif r.role == "scheduler":
            assert r.returncode == EXIT_PEER_FAILED and "server" in r.output and "died" in r.output, r


def test_a_missing_worker_makes_registration_time_out_naming_what_is_missing():
    env = {"PSLAUNCH_REGISTER_TIMEOUT": "1.5"}
    with LocalJob(3, 2, worker=script("sums.py"), env=env, start_workers=2) as job:
        results = job.wait(30)
    scheduler = next(r for r in results if r.role == "scheduler")
    assert scheduler.returncode == 1, scheduler
    assert "registration timed out after 1.5 s" in scheduler.output and "missing: 1 worker" in scheduler.output, scheduler
    assert "2 of 3 workers" in scheduler.output and "2 of 2 servers" in scheduler.output, scheduler
    for r in results:
        if r.role != "scheduler":
            assert r.returncode != 0 and "missing: 1 worker" in r.output, r


@pytest.mark.parametrize("keyed", [True, False], ids=["with a job key", "without a key"])
def test_garbage_sent_to_a_servers_port_is_dropped_and_results_stay_exact(tmp_path, keyed):
    go = tmp_path / "go"
    with LocalJob(2, 2, worker=script("garbage_sums.py", str(go)), env={"PS_VERBOSE": "1"}, job_key=keyed or None) as job:
        wait_for_line(job, "worker", None, r"^READY")  # printed by rank 0
        ports = [int(wait_for_line(job, "server", i, r"server@127\.0\.0\.1:(\d+) registering").group(1)) for i in range(2)]
        ctx = zmq.Context()
        try:
            for port in ports:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # not even ZMTP
                    raw.sendall(b"\x00\xffGET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
                dealer = ctx.socket(zmq.DEALER)
                dealer.linger = 0
                dealer.identity = b"worker@127.0.0.1:1"
                # with a key the server refuses the handshake, and a DEALER left with no peer blocks
                # in send: as soon as that happened (before the first send, on a fast machine) the
                # rest cannot be queued, which is the point
                dealer.sndtimeo = 500
                dealer.connect(f"tcp://127.0.0.1:{port}")
                for frames in ([b"garbage"], [pack_header(Cmd.PUSH, 1, 1), b"\x01\x02\x03", b"x" * 100],
                               [pack_header(Cmd.PULL, 2, 1), b"\xff" * 40], [b"PS\x09" + b"\x00" * 21]):
                    try:
                        dealer.send_multipart(frames)
                    except zmq.Again:
                        assert keyed, "a server without a key refused a connection"
                        break
                time.sleep(0.1)
                dealer.close(0)
        finally:
            ctx.destroy(linger=0)  # never hang on a socket a failure above left open
        go.write_text("go")
        results = job.wait(60)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(map(str, failed))
    assert sum(r.output.count("OK ") for r in results if r.role == "worker") == 2
    servers = [r for r in results if r.role == "server"]
    # with a key the stranger never gets a connection, so nothing of it is even parsed; without one its
    # messages are dropped as malformed
    assert all(("malformed" in r.output) != keyed for r in servers), "\n".join(map(str, servers))


def test_a_user_script_started_for_every_role_runs_scheduler_and_server_inside_import_kvcore():
    argv = [sys.executable, *script("role_script.py")]
    with LocalJob(2, 1, start_scheduler=False, start_servers=0) as job:
        job.start("scheduler", 0, argv)
        job.start("server", 0, argv)
        for i in range(2):
            job.start("worker", i, argv, {"DMLC_ROLE": ""})  # unset role: a worker, MXNet's rule
        results = job.wait(60)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(map(str, failed))
    assert sorted(r.output.strip().splitlines()[-1] for r in results if r.role == "worker") == ["OK 0", "OK 1"]


@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_python_m_psnode_with_a_malformed_variable_exits_2_naming_it(role):
    with LocalJob(1, 1, start_scheduler=False, start_servers=0) as job:
        job.start(role, 0, [sys.executable, "-m", "psnode", role], {"DMLC_NUM_SERVER": "two"})
        [result] = job.wait(30)
    assert result.returncode == 2 and "DMLC_NUM_SERVER='two'" in result.output, result


def test_the_ported_mxnet_dist_sync_check_passes_with_every_role_running_the_script():
    example = str(Path(__file__).resolve().parents[2] / "examples" / "dist_kvstore_check.py")
    argv = [sys.executable, example]
    with LocalJob(3, 2, start_scheduler=False, start_servers=0, env=SMALL_BOUND) as job:
        job.start("scheduler", 0, argv)
        for i in range(2):
            job.start("server", i, argv)
        for i in range(3):
            job.start("worker", i, argv, {"DMLC_ROLE": ""})
        results = job.wait(90)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(map(str, failed))
    passed = sorted(r.output.strip().splitlines()[-1] for r in results if r.role == "worker")
    assert passed == [f"worker {i}/3: all checks passed" for i in range(3)]


@pytest.mark.unit
def test_lists_of_many_small_keys_stay_exact_when_the_access_pattern_changes():
    run_inproc("key_lists.py", workers=3, servers=2)


@pytest.mark.unit
def test_a_key_list_pushed_every_step_sums_exactly_and_a_call_that_differs_fails_as_it_did_the_first_time():
    run_inproc("key_list_plans.py", workers=2, servers=2)


@pytest.mark.unit
def test_a_user_updater_with_init_key_runs_on_the_servers_and_its_errors_reach_the_workers():
    run_inproc("updater_protocol.py", workers=2, servers=2)


@pytest.mark.unit
def test_push_copies_its_values_and_pull_handles_complete_with_callbacks_in_dist_device_sync():
    run_inproc("handles.py", workers=2, servers=2)


def test_creating_a_dist_store_without_the_environment_names_the_missing_variable():
    with LocalJob(1, 1, start_scheduler=False, start_servers=0) as job:
        job.start("worker", 0, [sys.executable, "-c", "import kvcore; kvcore.create('dist_sync')"],
                  {"DMLC_ROLE": "", "DMLC_PS_ROOT_URI": ""})
        [result] = job.wait(30)
    # one line, as pslaunch's own errors are (kvcore.EnvContractError, a DistributedError, uncaught)
    assert result.returncode == 1 and result.output.startswith("kvcore: error: environment variable DMLC_PS_ROOT_URI is "
                                                               "not set") and len(result.output.splitlines()) == 1, result


def test_killing_the_scheduler_makes_every_node_fail_naming_it():
    env = {"PS_HEARTBEAT_INTERVAL": "0.2", "PS_HEARTBEAT_TIMEOUT": "1.5"}
    with LocalJob(2, 1, worker=script("loop_until_failure.py"), env=env) as job:
        for i in range(2):
            wait_for_line(job, "worker", i, r"^READY")
        job.of("scheduler").kill()
        results = job.wait(20)
    for r in results:
        if r.role == "worker":
            assert r.returncode == 3 and re.search(r"^DIED scheduler 0 .*the scheduler at 127\.0\.0\.1:\d+ died", r.output, re.M), r
        elif r.role == "server":
            assert r.returncode == EXIT_PEER_FAILED and "the scheduler at 127.0.0.1" in r.output, r


def test_two_workers_asking_for_the_same_worker_id_are_refused_naming_both():
    fixed = [{"DMLC_WORKER_ID": "0"}, {"DMLC_WORKER_ID": "0"}]
    with LocalJob(2, 1, worker=script("sums.py"), worker_env=fixed) as job:
        results = job.wait(30)
    for r in results:
        assert r.returncode != 0 and "two workers asked for DMLC_WORKER_ID=0" in r.output, r


@pytest.mark.parametrize("args", [("4",), ("1048576",), ("1048576", "after-finish")],
                         ids=["small", "shared-memory", "shared-memory-after-finish"])
def test_a_pull_waiting_for_a_worker_that_already_finished_fails_naming_it_instead_of_hanging(args):
    run_ok("uneven.py", workers=2, servers=1, args=args)


def test_server_device_gpu_keeps_results_exact_and_falls_back_to_the_cpu_with_a_warning_without_one():
    import kvcore.arrays

    results = run_ok("sums.py", workers=2, servers=2, env={"PSLAUNCH_SERVER_DEVICE": "gpu"})
    servers = [r for r in results if r.role == "server"]
    if not kvcore.arrays.gpu_available():
        assert all("no usable GPU 0 (" in r.output and "the server keeps its shards on the CPU" in r.output
                   for r in servers), servers
    else:
        assert not any("keeps its shards on the CPU" in r.output for r in servers), servers


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_device_values_merge_and_server_shards_update_where_asked_with_an_optimizer_rows_and_async(kind):
    # Every server update checks where its arrays live (device_updater.py), so a silent fallback
    # to the CPU fails the workers' pulls; the worker checks where dist_device_sync summed.
    env = {"PYTHONPATH": f"{SCRIPTS}:{Path(__file__).resolve().parents[2]}", "PSLAUNCH_SERVER_DEVICE": kind}
    results = run_ok("device_paths.py", workers=2, servers=2, env=env, args=(kind,), timeout=120)
    servers = [r for r in results if r.role == "server"]
    assert not any("keeps its shards on the CPU" in r.output for r in servers), servers


@pytest.mark.unit
def test_threads_waiting_at_once_and_a_callback_that_waits_all_get_exact_values():
    run_inproc("threads_wait.py", workers=2, servers=2)


def test_group_barriers_hold_workers_and_servers_and_refuse_outsiders(tmp_path):
    marker = str(tmp_path / "marker")
    with LocalJob(2, 2, worker=script("group_barrier_worker.py", marker), start_servers=0) as job:
        for i in range(2):
            job.start("server", i, [sys.executable, *script("group_barrier_server.py", marker)])
        results = job.wait(60)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(str(r) for r in failed)
    servers = [r for r in results if r.role == "server"]
    assert all("PASSED servers" in r.output and "PASSED all" in r.output for r in servers), "\n".join(map(str, servers))
    assert sorted(r.index for r in results if r.role == "worker" and re.search(r"^OK \d", r.output, re.M)) == [0, 1]


def test_a_barrier_of_all_nodes_fails_naming_a_server_that_died(tmp_path):
    marker = str(tmp_path / "marker")
    env = {"PS_HEARTBEAT_INTERVAL": "0.2", "PS_HEARTBEAT_TIMEOUT": "2"}
    with LocalJob(2, 2, worker=script("group_barrier_worker.py", marker), start_servers=0, env=env) as job:
        for i in range(2):
            job.start("server", i, [sys.executable, *script("group_barrier_server.py", marker, "die")])
        results = job.wait(60)
    assert len([r for r in results if r.role == "server" and r.returncode == 3]) == 1, "\n".join(map(str, results))
    for r in results:
        if r.role == "worker" or (r.role == "server" and r.returncode != 3):
            assert r.returncode not in (0, None) and re.search(r"server \d on .* died", r.output), str(r)


def test_one_frame_round_trips_the_server_refuses_fail_naming_why_and_later_rounds_stay_exact():
    results = run_ok("bad_round_trips.py", workers=1, servers=1)
    assert all(r.returncode == 0 for r in results), "\n".join(str(r) for r in results)


def test_pushes_sent_on_their_own_are_acknowledged_on_the_next_value_reply_and_values_stay_exact():
    run_ok("acks_on_values.py", workers=2, servers=1)


@pytest.mark.unit
def test_every_mxnet_dtype_and_zero_size_keys_work_others_are_refused_and_a_refused_init_fails_every_rank():
    printed = run_inproc_ok(script("values.py"), 3, 2)
    refusals = {line.split(" ", 2)[2] for text in printed.values() for line in text.splitlines() if line.startswith("REFUSED")}
    assert len(refusals) == 1 and "key 'again' is already initialised" in refusals.pop()


def test_big_pushes_go_by_invitation_over_tcp_when_a_small_push_window_is_set():
    """``PSLAUNCH_PUSH_WINDOW`` set by hand in every process: 3 workers x the split key's 2.88 MB half
    per server pass the 4 MiB window, so every push of it is offered first and sent when invited
    (``psnode.server.invitations``), over TCP; every round still sums exactly."""
    results = run_job_ok(script("sums.py"), 3, 2, env={"PSLAUNCH_PUSH_WINDOW": str(4 << 20), "PSLAUNCH_SAME_HOST": "tcp",
                                                     "PS_VERBOSE": "1"}, timeout=90)
    servers = [r.output for r in results if r.role == "server"]
    assert len(servers) == 2 and all("come by invitation" in out for out in servers), servers
