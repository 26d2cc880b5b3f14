"""Planning is pure: placement, argv and environment of every process, without starting anything."""

from __future__ import annotations

import re

import pytest

import pscontract as ec
from launcher import EnvVar, Host, LaunchConfig, PlacementError, format_plan, make_plan
from launcher.config import ConfigError, parse_env_option
from launcher.planning.plan import THREAD_VARIABLES

pytestmark = pytest.mark.unit


def _config(**kw) -> LaunchConfig:
    base = dict(command=("train.py", "--lr", "0.1 x"), num_workers=2, num_servers=1, scheduler_port=9000,
                python="/py", job_id="j1")
    base.update(kw)
    return LaunchConfig(**base)


def _where(plan, role):
    return [p.host.name for p in plan.by_role(role)]


def test_local_plan_runs_bundled_runtime_for_scheduler_and_servers_and_py_command_under_python():
    plan = make_plan(_config())
    assert [p.name for p in plan.processes] == [
        "scheduler.0@localhost", "server.0@localhost", "worker.0@localhost", "worker.1@localhost"]
    assert plan.by_role("scheduler")[0].argv == ("/py", "-m", "psnode", "scheduler")
    assert plan.by_role("server")[0].argv == ("/py", "-m", "psnode", "server")
    assert plan.by_role("worker")[1].argv == ("/py", "train.py", "--lr", "0.1 x")
    assert all(p.on_launcher and p.cwd is None for p in plan.processes)


@pytest.mark.parametrize(("command", "argv", "script"), [
    (("python", "train.py", "-x"), ("/py", "train.py", "-x"), "train.py"),
    (("python3", "sub/t.py"), ("/py", "sub/t.py"), "sub/t.py"),
    (("train.py",), ("/py", "train.py"), "train.py"),
    (("python", "-m", "pkg.train"), ("/py", "-m", "pkg.train"), None),
    (("python3.11", "train.py"), ("python3.11", "train.py"), None),
    (("./run.sh", "train.py"), ("./run.sh", "train.py"), None),
])
def test_python_and_python3_run_the_jobs_interpreter_and_the_script_is_known(command, argv, script):
    worker = make_plan(_config(command=command)).by_role("worker")[0]
    assert (worker.argv, worker.script) == (argv, script)


def test_pythonunbuffered_is_the_users_value_when_set():
    plan = make_plan(_config(python_unbuffered="0"))
    assert {p.env["PYTHONUNBUFFERED"] for p in plan.processes} == {"0"}
def test_zero_servers_plans_the_scheduler_and_the_workers_and_dry_run_says_allreduce():
    plan = make_plan(_config(num_workers=3, num_servers=0))
    assert [p.role for p in plan.processes] == ["scheduler", "worker", "worker", "worker"]
    assert all(p.env[ec.DMLC_NUM_SERVER] == "0" for p in plan.processes)
    assert plan.by_role("scheduler")[0].env[ec.PSLAUNCH_LOCAL_SIZE] == "1"
    text = format_plan(plan)
    assert "0 server(s), 3 worker(s)" in text and "allreduce mode: no servers" in text
    assert "allreduce mode" not in format_plan(make_plan(_config()))


def test_command_for_all_roles_runs_the_user_command_everywhere():
    plan = make_plan(_config(command=("mytool", "a"), user_command_for_all_roles=True))
    assert {p.argv for p in plan.processes} == {("mytool", "a")}


def test_contract_variables_of_every_process():
    plan = make_plan(_config(num_workers=3, num_servers=2))
    for p in plan.processes:
        assert p.env[ec.DMLC_ROLE] == p.role
        assert p.env[ec.DMLC_PS_ROOT_URI] == "127.0.0.1"
        assert p.env[ec.DMLC_PS_ROOT_PORT] == "9000"
        assert p.env[ec.DMLC_NUM_WORKER] == "3"
        assert p.env[ec.DMLC_NUM_SERVER] == "2"
        assert p.env[ec.PSLAUNCH_JOB_ID] == "j1"
        assert p.env[ec.PSLAUNCH_RANK] == str(p.rank)
        assert set(ec.REQUIRED) <= set(p.env)
        assert set(p.env) - {"PYTHONUNBUFFERED", *THREAD_VARIABLES} <= set(ec.WRITTEN)
        assert p.env[ec.PSLAUNCH_SUPERVISED] == "1" and p.env["PYTHONUNBUFFERED"] == "1"
    workers = plan.by_role("worker")
    assert [(w.env[ec.PSLAUNCH_LOCAL_RANK], w.env[ec.PSLAUNCH_LOCAL_SIZE]) for w in workers] == [
        ("0", "3"), ("1", "3"), ("2", "3")]


def test_workers_spread_over_hosts_respecting_slots_and_servers_round_robin():
    hosts = (Host("a", slots=1), Host("b", slots=3), Host("c"))
    plan = make_plan(_config(backend="ssh", hosts=hosts, num_workers=6, num_servers=4, launch_address="10.0.0.1"))
    assert _where(plan, "worker") == ["a", "b", "c", "b", "c", "b"]
    assert _where(plan, "server") == ["a", "b", "c", "a"]
    assert _where(plan, "scheduler") == ["localhost"]
    assert plan.root_uri == "10.0.0.1"
    b_workers = [w for w in plan.by_role("worker") if w.host.name == "b"]
    assert [(w.local_rank, w.local_size) for w in b_workers] == [(0, 3), (1, 3), (2, 3)]
    assert not any(p.on_launcher for p in plan.processes if p.role != "scheduler")
    assert plan.by_role("scheduler")[0].on_launcher


def test_too_many_workers_for_the_slots_is_an_error_naming_counts_and_hosts():
    hosts = (Host("a", slots=1), Host("b", slots=2))
    with pytest.raises(PlacementError, match=r"4 workers do not fit the 3 slots of the hostfile \(a slots=1, b slots=2\)"):
        make_plan(_config(backend="ssh", hosts=hosts, num_workers=4))


def test_scheduler_host_places_the_scheduler_there_and_every_node_dials_its_real_name():
    from launcher.planning.network import resolve

    hosts = (Host("a", "u", 2200), Host("b"))
    config = resolve(_config(backend="ssh", hosts=hosts, scheduler_host="a"), real_names=[("a", "10.0.0.7"), ("b", "b")])
    plan = make_plan(config)
    sched = plan.by_role("scheduler")[0]
    assert sched.host == Host("a", "u", 2200) and not sched.on_launcher
    assert plan.root_uri == "10.0.0.7"  # ssh config's HostName of the alias a
    assert {p.env[ec.DMLC_PS_ROOT_URI] for p in plan.processes} == {"10.0.0.7"}


def test_loopback_hosts_get_root_uri_127_0_0_1_and_advertise_their_own_address():
    hosts = (Host("127.0.0.2"), Host("127.0.0.3"))
    plan = make_plan(_config(backend="ssh", hosts=hosts))
    assert plan.root_uri == "127.0.0.1"
    assert [w.env[ec.DMLC_NODE_HOST] for w in plan.by_role("worker")] == ["127.0.0.2", "127.0.0.3"]
    assert all(p.env[ec.DMLC_LOCAL] == "1" for p in plan.processes)


def test_remote_nodes_advertise_their_interface_toward_the_scheduler_or_the_interface_given():
    hosts = (Host("10.0.0.2"), Host("node3"))
    plan = make_plan(_config(backend="ssh", hosts=hosts, launch_address="10.0.0.1"))
    remote = [p for p in plan.processes if not p.on_launcher]
    # a hostfile's address may be on another network than the one toward the scheduler
    assert remote and not any(ec.DMLC_NODE_HOST in p.env or ec.DMLC_INTERFACE in p.env for p in remote)
    plan = make_plan(_config(backend="ssh", hosts=hosts, launch_address="10.0.0.1", interface="ib0,eth0"))
    assert {p.env[ec.DMLC_INTERFACE] for p in plan.processes} == {"ib0,eth0"}


def test_remote_processes_start_in_the_sync_dir():
    plan = make_plan(_config(backend="ssh", hosts=(Host("h"),), sync_dst_dir="/tmp/job", cwd="/home/me"))
    assert {p.cwd for p in plan.processes if not p.on_launcher} == {"/tmp/job"}


def test_env_scopes_reach_their_roles_and_values_never_show_in_the_dry_run_text():
    env = (EnvVar("TOKEN", "s3cr3t-value"), EnvVar("SRV", "srv-secret", "server"), EnvVar("WRK", "wrk-secret", "worker"))
    plan = make_plan(_config(env=env))
    assert {v.name for v in plan.by_role("worker")[0].user_env} == {"TOKEN", "WRK"}
    assert {v.name for v in plan.by_role("server")[0].user_env} == {"TOKEN", "SRV"}
    assert {v.name for v in plan.by_role("scheduler")[0].user_env} == {"TOKEN", "SRV"}
    assert plan.by_role("worker")[0].full_env()["TOKEN"] == "s3cr3t-value"
    text = format_plan(plan) + repr(plan)
    for secret in ("s3cr3t-value", "srv-secret", "wrk-secret"):
        assert secret not in text
    assert "TOKEN" in text and "--lr '0.1 x'" in text


def test_env_option_forms_and_errors_that_never_show_values():
    environ = {"HOME_TOKEN": "abc"}
    assert parse_env_option("A:b:c", "all", environ) == EnvVar("A", "b:c")
    assert parse_env_option("A=x=y", "all", environ) == EnvVar("A", "x=y")
    assert parse_env_option("HOME_TOKEN", "worker", environ) == EnvVar("HOME_TOKEN", "abc", "worker")
    assert parse_env_option("E:", "all", environ).value == ""
    with pytest.raises(ConfigError, match="--env-server MISSING: forwards pslaunch's own MISSING, but it is not set"):
        parse_env_option("MISSING", "server", environ)
    with pytest.raises(ConfigError, match=r"--env: '1BAD' is not a variable name") as info:
        parse_env_option("1BAD:topsecret", "all", environ)
    assert "topsecret" not in str(info.value)


def test_config_rejects_bad_counts_naming_the_flag_and_value():
    with pytest.raises(ConfigError, match="-n/--num-workers must be >= 1, got 0"):
        _config(num_workers=0)
    with pytest.raises(ConfigError, match=r"-s/--num-servers must be >= 0 \(0: no servers.*got -1"):
        _config(num_servers=-1)
    with pytest.raises(ConfigError, match="no COMMAND given"):
        _config(command=())


def test_resolve_picks_a_free_local_port_and_never_a_loopback_address_for_a_remote_host():
    from launcher.planning.network import resolve

    local = resolve(_config(scheduler_port=None))
    assert 1 <= local.scheduler_port <= 65535 and local.launch_address == "127.0.0.1"
    assert resolve(_config(backend="ssh", hosts=(Host("127.0.0.2"),)), real_names=[("127.0.0.2", "127.0.0.2")]
                   ).launch_address == "127.0.0.1"
    # lo is a loopback address: for a remote host the route toward it decides instead
    remote = resolve(_config(backend="ssh", hosts=(Host("10.1.2.3"),), interface="lo"),
                     real_names=[("10.1.2.3", "10.1.2.3")])
    assert not remote.launch_address.startswith("127.") and make_plan(remote).root_uri == remote.launch_address
    with pytest.raises(ConfigError, match=r"--interface nope0: nothing here matches it \(interfaces: .*lo 127.0.0.1"):
        resolve(_config(interface="nope0"))
    with pytest.raises(ConfigError, match=r"--interface 'eth0;rm' is not an interface name"):
        resolve(_config(interface="eth0;rm"))
    assert resolve(_config(scheduler_host="h", scheduler_port=None)).scheduler_port == 9091


def test_every_worker_gets_torchruns_rank_variables_and_only_a_job_without_servers_a_master():
    hosts = (Host("a", slots=2), Host("b", slots=1))
    plan = make_plan(_config(backend="ssh", hosts=hosts, num_workers=3, num_servers=0, master_port=29500,
                             launch_address="10.0.0.9"))
    got = [(p.env["RANK"], p.env["WORLD_SIZE"], p.env["LOCAL_RANK"], p.env["LOCAL_WORLD_SIZE"], p.env["MASTER_ADDR"],
            p.env["MASTER_PORT"]) for p in plan.by_role("worker")]
    # round robin over the hosts: a, b, a
    assert got == [("0", "3", "0", "2", "a", "29500"), ("1", "3", "0", "1", "a", "29500"), ("2", "3", "1", "2", "a", "29500")]
    assert not any("RANK" in p.env or "MASTER_ADDR" in p.env for p in plan.by_role("scheduler"))
    assert "CUDA_VISIBLE_DEVICES" not in plan.by_role("worker")[0].env  # untouched without --gpus-per-worker
    with_servers = make_plan(_config(num_workers=2, num_servers=1, master_port=None))
    assert [p.env["RANK"] for p in with_servers.by_role("worker")] == ["0", "1"]
    assert not any("MASTER_ADDR" in p.env for p in (*with_servers.processes, *plan.by_role("server")))


def test_the_master_of_a_job_on_this_machine_is_a_loopback_address_with_a_free_port():
    from launcher.planning.network import resolve

    local = resolve(_config(num_servers=0, scheduler_port=None))
    worker0 = make_plan(local).by_role("worker")[0].env
    assert worker0["MASTER_ADDR"] == "127.0.0.1" and worker0["MASTER_PORT"] == str(local.master_port)
    on_loopback_hosts = resolve(_config(backend="ssh", hosts=(Host("127.0.0.3"), Host("127.0.0.2")), num_servers=0),
                                real_names=[("127.0.0.3", "127.0.0.3"), ("127.0.0.2", "127.0.0.2")])
    assert make_plan(on_loopback_hosts).by_role("worker")[0].env["MASTER_ADDR"] == "127.0.0.3"
    # with servers too: a plain torch script gets MASTER_ADDR and MASTER_PORT whatever -s is
    with_servers = resolve(_config(num_servers=1, scheduler_port=None))
    assert with_servers.master_port not in (None, with_servers.scheduler_port)
    assert make_plan(with_servers).by_role("worker")[1].env["MASTER_PORT"] == str(with_servers.master_port)
    # worker 0 on this machine, another host remote: the remote workers dial this machine's address
    mixed = _config(backend="ssh", hosts=(Host("localhost"), Host("node2")), num_servers=0, master_port=29500,
                    launch_address="10.0.0.9")
    assert make_plan(mixed).by_role("worker")[0].env["MASTER_ADDR"] == "10.0.0.9"


@pytest.mark.parametrize(("gpus", "visible"), [(1, ["0", "1", "2"]), (2, ["0,1", "2,3", "4,5"])])
def test_gpus_per_worker_gives_each_local_rank_its_own_gpus(gpus, visible):
    plan = make_plan(_config(num_workers=3, gpus_per_worker=gpus))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan.by_role("worker")] == visible
    with pytest.raises(ConfigError, match="--gpus-per-worker must be >= 1, got 0"):
        _config(gpus_per_worker=0)


def test_the_readmes_hostfile_example_places_as_its_comment_says():
    from pathlib import Path

    from launcher import parse_hostfile_text

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("### The hostfile", 1)[1].split("```\n", 2)[1]
    comment = block.splitlines()[0]
    workers, servers = re.search(r"workers on ([a-z, ]+) and servers on ([a-z, ]+)", comment).groups()
    hosts = tuple(parse_hostfile_text(block, "README.md"))
    plan = make_plan(_config(backend="ssh", hosts=hosts, num_workers=6, num_servers=4))
    assert [p.host.name for p in plan.by_role("worker")] == workers.split(", ")
    assert [p.host.name for p in plan.by_role("server")] == servers.split(", ")
    assert (hosts[0].user, hosts[1].port) == ("alice", 2222)
