"""``--launcher ray`` before Ray is asked anything: its options, the placement group's bundles, which
bundle each process takes, the plan moved onto the nodes, and what an unplaceable group lacks. Pure:
nothing here imports Ray or starts a process (the tests on a real Ray cluster: test_ray_backend.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

import pscontract as ec
from launcher.backends import get_backend
from launcher.backends.ray.placement import PENDING_HOST, assign_bundles, place
from launcher.backends.ray.settings import RaySettings, bundles_for, shortfall
from launcher.cli import build_config, cli, main
from launcher.errors import ConfigError
from launcher.on_node.ray_actor import OutputBuffer
from launcher.planning.plan import make_plan

pytestmark = pytest.mark.unit


def _config(*args: str, environ: dict | None = None):
    ctx = cli.make_context("pslaunch", ["--launcher", "ray", *args, "train.py"])
    config = build_config(ctx.params, {})
    return get_backend("ray").configure(config, environ or {})


def test_without_options_each_process_asks_for_one_cpu_of_the_cluster_at_ray_address():
    config = _config("-n", "2", "-s", "1")
    settings = RaySettings.from_config(config, {"RAY_ADDRESS": "10.1.2.3:6379"})
    assert settings.address == "10.1.2.3:6379" and settings.strategy == "spread" and settings.timeout == 60
    assert bundles_for(["scheduler", "server", "worker", "worker"], settings) == [{"CPU": 1.0}] * 4
    assert RaySettings.from_config(config, {}).address == "auto"


def test_per_role_resources_give_each_role_its_bundle():
    config = _config("-n", "2", "-s", "1", "--ray-worker-resources", '{"CPU": 2, "GPU": 1}', "--ray-server-resources",
                     '{"CPU": 4, "memory": 1e9}', "--ray-address", "ray://head:10001")
    settings = RaySettings.from_config(config, {"RAY_ADDRESS": "ignored:1"})
    assert settings.address == "ray://head:10001"
    assert bundles_for(["scheduler", "server", "worker"], settings) == [
        {"CPU": 1.0}, {"CPU": 4.0, "memory": 1e9}, {"CPU": 2.0, "GPU": 1.0}]


@pytest.mark.parametrize("args, message", [
    (["--ray-worker-resources", "{CPU: 1}"], "--ray-worker-resources '{CPU: 1}' is not JSON"),
    (["--ray-server-resources", '{"GPU": -1}'], "--ray-server-resources: GPU -1 is not an amount"),
    (["--ray-worker-resources", '{"CPU": 0}'], "asks for nothing: Ray places no empty bundle"),
    (["--ray-worker-resources", "[1]"], "expected a JSON object of amounts"),
    (["--ray-timeout", "soon"], "--ray-timeout 'soon': expected a number of seconds > 0"),
    (["--ray-timeout", "0"], "--ray-timeout '0': expected a number of seconds > 0"),
    (["--gpus-per-worker", "1"], """--ray-worker-resources '{"CPU": 1, "GPU": K}'"""),
    (["-H", "/etc/hostname"], "-H/--hostfile is not an option of --launcher ray: Ray places the processes"),
])
def test_bad_ray_options_are_refused_naming_the_flag(args, message):
    with pytest.raises(ConfigError) as refused:
        _config("-n", "2", *args)
    assert message in str(refused.value)


def test_a_ray_option_with_another_launcher_is_refused(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["-n", "2", "--launcher", "local", "--ray-timeout", "5", "train.py"])
    assert ended.value.code == 2
    assert "--ray-timeout is not an option of --launcher local" in capsys.readouterr().err


def test_the_dry_run_shows_the_placement_group_and_placeholder_nodes(capsys, tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(["-n", "2", "-s", "2", "--launcher", "ray", "--ray-strategy", "pack", "--dry-run", "train.py"])
    assert ended.value.code == 0
    out = capsys.readouterr().out
    assert "backend ray, scheduler at <ray-node>:" in out and "worker.1@<ray-node>" in out
    assert ("one placement group of 5 bundles (--ray-strategy pack, Ray's PACK): scheduler {\"CPU\": 1.0}; "
            "server {\"CPU\": 1.0}; worker {\"CPU\": 1.0}") in out
    assert f"runtime_env working_dir ({tmp_path})" in out


def test_servers_take_bundles_on_distinct_nodes_whatever_order_ray_placed_them_in():
    cpu = {"CPU": 1.0}
    roles = ["scheduler", "server", "server", "worker", "worker"]
    chosen = assign_bundles(roles, [cpu] * 5, ["a", "a", "a", "b", "b"])
    nodes = ["a", "a", "a", "b", "b"]
    assert sorted(chosen) == [0, 1, 2, 3, 4]
    assert {nodes[chosen[1]], nodes[chosen[2]]} == {"a", "b"}  # the servers
    assert {nodes[chosen[3]], nodes[chosen[4]]} == {"a", "b"}  # the workers


def test_a_process_takes_only_a_bundle_of_its_own_roles_shape():
    cpu, gpu = {"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}
    roles = ["scheduler", "server", "worker", "worker"]
    chosen = assign_bundles(roles, [cpu, cpu, gpu, gpu], ["a", "b", "b", "a"])
    assert sorted(chosen[:2]) == [0, 1] and sorted(chosen[2:]) == [2, 3]


def test_the_placed_plan_names_each_processs_node_and_redoes_what_follows_from_hosts():
    config = _config("-n", "3", "-s", "0")
    plan = make_plan(config)
    assert {spec.host for spec in plan.processes} == {PENDING_HOST}
    placed = place(plan, config, ["10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.2"], 23456, 24567)
    scheduler, w0, w1, w2 = placed.processes
    assert placed.root_uri == "10.0.0.2" and placed.root_port == 23456
    assert [s.name for s in placed.processes] == ["scheduler.0@10.0.0.2", "worker.0@10.0.0.1", "worker.1@10.0.0.2",
                                                  "worker.2@10.0.0.2"]
    assert all(s.env[ec.DMLC_PS_ROOT_URI] == "10.0.0.2" and s.env[ec.DMLC_PS_ROOT_PORT] == "23456"
               for s in placed.processes)
    assert [(s.env[ec.LOCAL_RANK], s.env[ec.LOCAL_WORLD_SIZE]) for s in (w0, w1, w2)] == [("0", "1"), ("0", "2"),
                                                                                         ("1", "2")]
    assert w2.env[ec.PSLAUNCH_LOCAL_RANK] == "1" and w2.env[ec.DMLC_NODE_HOST] == "10.0.0.2"
    assert (w1.env[ec.MASTER_ADDR], w1.env[ec.MASTER_PORT]) == ("10.0.0.1", "24567")  # worker 0's node
    assert all(s.cwd is None and not s.on_launcher for s in placed.processes)  # Ray's working directory
    assert w0.argv[0] == sys.executable  # each node swaps in its own Python (the actor)


def test_an_unplaceable_group_names_what_the_cluster_lacks():
    gpu = {"CPU": 1.0, "GPU": 1.0}
    nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    total = {"CPU": 16.0, "GPU": 2.0}
    assert shortfall([{"CPU": 1.0}] + [gpu] * 4, total, total, nodes, "spread") == "needs 4 GPU, cluster has 2"
    assert shortfall([{"CPU": 12.0}], total, total, nodes, "spread") == (
        'no node of the cluster can hold a bundle of {"CPU": 12.0} (the largest node has 8 CPU)')
    busy = shortfall([{"CPU": 4.0}] * 2, total, {"CPU": 6.0, "GPU": 2.0}, nodes, "pack")
    assert busy == "needs 8 CPU, 6 of the cluster's 16 are free (other jobs hold the rest)"


def test_an_actors_output_buffer_holds_back_a_chatty_process_and_loses_nothing():
    buffer = OutputBuffer(limit=10)
    buffer.put("stdout", b"0123456789")
    writer = threading.Thread(target=buffer.put, args=("stderr", b"late"))
    writer.start()
    time.sleep(0.05)
    assert writer.is_alive()  # full: the process's next write waits
    out, done = buffer.take(0.1, lambda: False)
    writer.join(1)
    assert out == {"stdout": b"0123456789"} and not done and not writer.is_alive()
    buffer.close_stream()
    buffer.close_stream()
    assert buffer.take(0.1, lambda: False) == ({"stderr": b"late"}, False)  # the guard still runs
    assert buffer.take(5, lambda: True) == ({}, True)  # at once: both streams ended and so did the guard
