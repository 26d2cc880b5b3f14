"""A real cluster, simulated: three hosts in network namespaces, each with its own sshd on port 22,
reached by ssh config aliases; a management network with the launching host on it, a compute-only
second network (``ib0``), and hosts whose management interfaces are named differently (``eth0``,
``ens5``). See ``testkit.netns`` and ``testkit.launcher.start_cluster``.

Marked ``netns`` (root and iproute2; ``scripts/test.sh`` runs them with the rest).
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

from testkit.launcher import cmdline, helper, processes_with, reaped, run_pslaunch, start_pslaunch, wait_gone
from testkit.launcher.elastic import check_exact, lines, records, wait_for

pytestmark = pytest.mark.netns


def _kv_job(cluster, out, *options, marker="", hosts=("node1", "node2")) -> list[str]:
    hostfile = cluster.hostfile("hosts-" + "-".join(hosts), list(hosts))
    return ["-n", "2", "-s", "2", "-H", hostfile, *cluster.ssh_flags(), "--timeout", "60", *options,
            sys.executable, helper("kv_worker.py"), str(out), marker]


def _advertised(output: str) -> dict[str, str]:
    """``{"server.0": "198.18.7.11", ...}`` from the nodes' ``registering`` lines (``-vv``)."""
    found = re.findall(r"^\[(server\.\d|worker\.\d)@\S+\] .* (?:server|worker)@([\d.]+):\d+ registering", output, re.M)
    return dict(found)


def test_an_alias_hostfile_puts_the_scheduler_on_the_address_this_machine_uses_toward_the_hosts(cluster):
    hosts = cluster.hostfile("aliases", ["node1", "node2"])
    res = run_pslaunch(["-n", "2", "-H", hosts, *cluster.ssh_flags(), "--dry-run", "train.py"], timeout=30)
    assert res.returncode == 0, res.stderr
    # not the alias, not this machine's host name (127.0.1.1 on Debian-style machines): the route's source
    assert f"scheduler at {cluster.net.launcher_address}:" in res.stdout
    assert f"DMLC_PS_ROOT_URI={cluster.net.launcher_address} " in res.stdout


def test_an_alias_hostfile_runs_a_kvcore_job_each_node_advertising_its_interface_toward_the_scheduler(
        cluster, tmp_path, marker):
    res = run_pslaunch(_kv_job(cluster, tmp_path, "-vv", marker=marker), timeout=90)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.glob("worker.*.txt")) == ["worker.0.txt", "worker.1.txt"]
    net = cluster.net
    assert _advertised(res.stderr) == {"server.0": net.address("h1"), "worker.0": net.address("h1"),
                                       "server.1": net.address("h2"), "worker.1": net.address("h2")}
    assert wait_gone(marker, 10) == []


def test_an_interface_list_is_resolved_on_each_host_whose_interface_names_differ(cluster, tmp_path):
    # node1 has eth0, node2 has ens5: one list serves both
    res = run_pslaunch(_kv_job(cluster, tmp_path, "--interface", "ens5,eth0", "-vv"), timeout=90)
    assert res.returncode == 0, res.stderr
    net = cluster.net
    assert _advertised(res.stderr) == {"server.0": net.address("h1"), "worker.0": net.address("h1"),
                                       "server.1": net.address("h2"), "worker.1": net.address("h2")}


def test_a_compute_only_network_carries_the_job_when_the_scheduler_runs_on_it(cluster, tmp_path):
    res = run_pslaunch(_kv_job(cluster, tmp_path, "--interface", "ib0", "--scheduler-host", "node1", "-vv"), timeout=90)
    assert res.returncode == 0, res.stderr
    net = cluster.net
    assert _advertised(res.stderr) == {"server.0": net.address("h1", "compute"), "worker.0": net.address("h1", "compute"),
                                       "server.1": net.address("h2", "compute"), "worker.1": net.address("h2", "compute")}
    # every node dials the scheduler host by its real address, not by the alias
    assert f"registering with the scheduler at {net.address('h1')}:" in res.stderr


def test_a_node_advertising_an_address_the_scheduler_cannot_reach_is_named_with_it_not_called_dead(cluster, tmp_path):
    net = cluster.net
    res = run_pslaunch(_kv_job(cluster, tmp_path, "--interface", net.subnet("compute")), timeout=90)
    assert res.returncode == 1, res.stderr
    cause = res.stderr.split("pslaunch: root cause: ", 1)[1]
    assert cause.startswith("scheduler.0@localhost"), res.stderr
    assert re.search(rf"server 0 advertised {re.escape(net.address('h1', 'compute'))}:\d+, which the scheduler at "
                     rf"{re.escape(net.launcher_address)} cannot reach \([^)]+\); nor server 1 at "
                     rf"{re.escape(net.address('h2', 'compute'))}:\d+ ", cause), res.stderr
    assert "set --interface" in cause and "no heartbeat" not in res.stderr


def test_a_host_that_cannot_reach_the_schedulers_address_stops_the_launch_naming_it_and_the_address(cluster, tmp_path,
                                                                                                     marker):
    # node1 is on the management network, node3c is h3 reached on the compute network only: the
    # scheduler's address (toward node1, the first host) is one h3 cannot reach.
    net = cluster.net
    config = tmp_path / "ssh_config"
    config.write_text(open(cluster.ssh_config).read().replace("Host node3\n", "Host node3c\n").replace(
        f"HostName {net.address('h3')}\n", f"HostName {net.address('h3', 'compute')}\n"))
    hosts = cluster.hostfile("split-networks", ["node1", "node3c"])
    net.join("compute")
    net.cut("h3", "management")
    try:
        res = run_pslaunch(["-n", "2", "-H", hosts, "--ssh-config", str(config), "--known-hosts", cluster.known_hosts,
                            "--connect-timeout", "2", sys.executable, helper("kv_worker.py"), str(tmp_path), marker],
                           timeout=60)
    finally:
        net.restore("h3", "management")
        net.leave("compute")
    assert res.returncode == 3, res.stderr
    assert res.stderr.startswith("pslaunch: error: 1 of 2 host(s) cannot reach the scheduler's address:\n"), res.stderr
    assert re.search(rf"^  node3c cannot reach the scheduler at {re.escape(net.launcher_address)}:\d+: "
                     r"no answer within 2 s$", res.stderr, re.M), res.stderr
    assert "node1 cannot" not in res.stderr and processes_with(marker) == []


def _wait_for_output(proc, text: str, timeout: float = 60) -> str:
    """Read pslaunch's stdout until a line holds ``text`` (fails if pslaunch ends first)."""
    seen = ""
    deadline = time.monotonic() + timeout
    while text not in seen:
        assert time.monotonic() < deadline, f"{text!r} did not come within {timeout} s:\n{seen}"
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
            assert chunk, f"pslaunch ended before {text!r}: {seen}{proc.communicate()}"
            seen += chunk
    return seen


def _job_processes(cluster, host: str) -> list[str]:
    """The job's processes still running in ``host``'s namespace (guards, the runtime, the helpers)."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.net.namespace(host)], capture_output=True, text=True,
                          timeout=10).stdout.split()
    found = [f"{pid}: {cmdline(int(pid))}" for pid in pids]
    return [line for line in found if re.search(r"pslaunch-guard|psnode|steps_worker|sleeper|rank_shim|orted", line)]


@pytest.mark.parametrize(("backend", "kind"), [("ssh", "kvcore"), ("ssh", "plain"), ("mpi", "plain")])
def test_a_link_dropped_mid_job_fails_it_naming_the_host_and_leaves_nothing_running_there(cluster, tmp_path, marker,
                                                                                          backend, kind):
    hosts = cluster.hostfile("two", ["node1", "node2"])
    if kind == "kvcore":
        job = ["--env", "STEPS:100000", "--env", "STEP_SLEEP:0.02", sys.executable, helper("steps_worker.py"), marker]
        started = "step 10"
    else:  # a program with its own scheduler and servers (MXNet, ps-lite, BytePS) that notices nothing
        job = ["--command-for-all-roles", sys.executable, helper("sleeper.py"), "600", marker]
        started = "[worker.1@node2] sleeping"
    net, link_timeout = cluster.net, 8
    with reaped(start_pslaunch(["-n", "2", "-s", "2", "-H", hosts, *cluster.ssh_flags(), "--launcher", backend,
                                "--link-timeout", str(link_timeout), "--stop-grace", "2", "--timeout", "120", *job]),
                marker) as proc:
        _wait_for_output(proc, started)
        net.cut("h2")
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            net.restore("h2")
    stderr = err.decode()
    assert proc.returncode == 255, stderr
    assert (f"pslaunch: root cause: host node2 lost (no answer for {link_timeout} s): pslaunch could not reach "
            "server.1@node2, worker.1@node2\n") in stderr, stderr
    rows = {f"{m[0]}.{m[1]}@{m[2]}": (m[3], m[4]) for m in re.findall(
        r"^\| (\w+) +\| +(\d+) \| (\w+) +\| +[-\d]+ \| ([^|]+?) +\| +[\d.]+s \| ([^|]*?) *\|$", stderr, re.M)}
    lost = f"host lost (no answer for {link_timeout} s)"
    assert rows["server.1@node2"] == (lost, "root cause, unreachable"), stderr
    assert rows["worker.1@node2"] == (lost, "unreachable"), stderr
    assert "did not end after SIGKILL" not in stderr
    # the guards on node2 (mpi: the rank shim) stopped their processes when pslaunch went quiet, and once
    # the link is back nothing is left anywhere (mpirun's daemon there ends when it finds mpirun gone)
    deadline = time.monotonic() + link_timeout + 10
    while (_job_processes(cluster, "h2") or processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _job_processes(cluster, "h2") == [] and processes_with(marker) == []


def test_the_mpi_backend_runs_across_hosts_with_the_ssh_settings_the_preflight_used_not_the_passwd_homes(
        cluster, tmp_path, marker):
    # Under `sudo -E` or in a container $HOME is not the passwd home directory, whose ~/.ssh/config
    # mpirun's own ssh would read: the aliases below are only in $HOME's.
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(open(cluster.ssh_config).read())
    hosts = cluster.hostfile("mpi-hosts", ["node1", "node2"])
    out = tmp_path / "out"
    out.mkdir()
    res = run_pslaunch(["-n", "2", "-s", "2", "-H", hosts, "--known-hosts", cluster.known_hosts, "--launcher", "mpi",
                        "--timeout", "60", sys.executable, helper("kv_worker.py"), str(out), marker],
                       timeout=90, env=dict(os.environ, HOME=str(home)))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.glob("worker.*.txt")) == ["worker.0.txt", "worker.1.txt"]
    assert "[worker.1@node2] worker 1 pulled 3.0" in res.stdout
    assert wait_gone(marker, 10) == []


def test_an_elastic_job_on_the_cluster_takes_a_host_its_discovery_script_adds_and_lets_it_go_again(cluster, tmp_path):
    # -n 2:3 on node1 and node2 (one slot each); the script then reports node3 too (its worker joins the
    # running job over the cluster's network) and drops it again (the worker leaves); every round exact
    out = tmp_path / "out"
    out.mkdir()
    capacity = tmp_path / "capacity.txt"
    capacity.write_text("node1:1\nnode2:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {capacity}\n")
    script.chmod(0o755)
    args = ["-n", "2:3", "-s", "2", "--host-discovery-script", str(script), *cluster.ssh_flags(), "--no-dashboard",
            "--env", "STEPS:60", "--env", "STEP_SLEEP:0.1", "--timeout", "90", sys.executable,
            helper("elastic_join.py"), str(out)]
    with reaped(start_pslaunch(args), str(out)) as proc:
        wait_for(lambda: len(lines(out, 0)) >= 4, 60)
        capacity.write_text("node1:1\nnode2:1\nnode3:1\n")
        wait_for(lambda: any(len(m) == 3 for m in records(out).values()), 60)
        grown = max(records(out))
        wait_for(lambda: max(records(out)) >= grown + 5, 60)
        capacity.write_text("node1:1\nnode2:1\n")
        _, err = proc.communicate(timeout=90)
    err = err.decode()
    assert proc.returncode == 0, err
    sizes = [len(m) for m in check_exact(records(out), 60)]
    first, last = sizes.index(3), len(sizes) - sizes[::-1].index(3) - 1
    assert sizes == [2] * first + [3] * (last - first + 1) + [2] * (len(sizes) - last - 1), sizes
    assert "node3 has a free slot (--host-discovery-script" in err and "starting worker.2@node3 to join the job" in err
    assert "node3 is no longer listed" in err and "[worker.2@node3] worker 2 left the job at a step boundary" in err
    assert not wait_gone(str(out))
