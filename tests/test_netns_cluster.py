"""testkit.netns, the simulated cluster: its hosts reach each other over their networks, the
launching host reaches only the management network, the range cannot leave the machine, and
nothing of a cluster is left after its block ends, raises, or its process is killed. The
capped-link benchmark runs on it (a quick run: it checks that it runs, not a figure).

Marked ``netns``: needs root and iproute2 (scripts/test.sh installs it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testkit import LocalJob
from testkit.netns import BENCH_RANGE, NetnsCluster, process_alive, usable

pytestmark = pytest.mark.netns
REPO = Path(__file__).resolve().parent.parent
REACH = "import socket,sys; s=socket.create_server((sys.argv[1],0)); print(s.getsockname()[1],flush=True); s.accept()"
CONNECT = "import socket,sys; socket.create_connection((sys.argv[1],int(sys.argv[2])),3).close()"


@pytest.fixture(autouse=True)
def _namespaces_work():
    why = usable()
    if why is not None:
        pytest.fail(f"the simulated cluster cannot be made here: {why}")


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10).stdout


def _reaches(cluster: NetnsCluster, source: str | None, target: str, network: str) -> bool:
    address = cluster.address(target, network)
    server = subprocess.Popen(cluster.run_in(target, [sys.executable, "-c", REACH, address]), stdout=subprocess.PIPE,
                              text=True)
    try:
        port = server.stdout.readline().strip()
        argv = [sys.executable, "-c", CONNECT, address, port]
        return subprocess.run(cluster.run_in(source, argv) if source else argv, capture_output=True,
                              timeout=30).returncode == 0
    finally:
        server.kill()
        server.wait()


def _leftovers(tag: str) -> list[str]:
    """Namespaces and links of the cluster(s) tagged ``tag`` (``<pid><letter>``, or a pid: every one)."""
    names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").splitlines()]
    mine = re.compile(rf"^(pslnet-|pn){tag}{'' if tag[-1].isalpha() else '[a-z]'}-")
    return [n for n in names + links if mine.match(n)]


def test_hosts_reach_each_other_on_both_networks_the_launcher_only_the_management_one_and_nothing_is_left():
    with pytest.raises(RuntimeError, match="inside"):
        with NetnsCluster(nics=("eth0", "ens5"), compute=True) as cluster:
            assert f"unreachable {BENCH_RANGE}" in _ip("route", "show")
            inside = _ip("-n", cluster.namespace("h2"), "-4", "-o", "addr")
            assert re.search(rf"^\d+: ens5\s+inet {re.escape(cluster.address('h2'))}/24 ", inside, re.M), inside
            assert _reaches(cluster, "h1", "h2", "management") and _reaches(cluster, "h1", "h2", "compute")
            assert _reaches(cluster, None, "h2", "management") and not _reaches(cluster, None, "h2", "compute")
            cluster.join("compute")
            assert _reaches(cluster, None, "h2", "compute")
            cluster.leave("compute")
            assert not _reaches(cluster, None, "h2", "compute")
            cluster.cut("h2")
            assert not _reaches(cluster, "h1", "h2", "management")
            cluster.restore("h2")
            assert _reaches(cluster, "h1", "h2", "management")
            tag = cluster.tag
            assert _leftovers(tag)
            raise RuntimeError("inside")
    assert _leftovers(tag) == []


def test_a_killed_runs_namespaces_and_what_ran_in_them_are_swept_by_the_next_cluster(tmp_path):
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from testkit.netns import NetnsCluster
        cluster = NetnsCluster(nics=("eth0",)).__enter__()
        sleeper = subprocess.Popen(cluster.run_in("h1", ["sleep", "600"]))
        print(cluster.namespace("h1"), sleeper.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        namespace, sleeper = proc.stdout.readline().split()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no finally, no atexit: the namespace stays behind
        proc.wait()
    tag = str(proc.pid)
    try:
        assert namespace in _ip("netns", "list") and _leftovers(tag)
        with NetnsCluster(nics=("eth0",)):
            assert _leftovers(tag) == [] and not process_alive(int(sleeper))
    finally:
        for name in _leftovers(tag):  # should the sweep have failed
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=10)


def test_the_capped_link_benchmark_runs_pslaunch_across_the_shaped_link(tmp_path):
    out = tmp_path / "capped.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.capped_link", "--quick", "--skip-mxnet", "--sizes", "1",
                          "--rate", "200mbit", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert row["measure"] == f"pushpull_{1 << 20}" and row["pslaunch_tcp"]["bytes_per_s"] > 0
    assert report["line_rate_bytes_per_s"] == 25e6 and report["tcp_stream"]["bytes_per_s"] > 0
    assert "pushpull 1 MiB" in res.stdout and "raw TCP stream" in res.stdout


def test_workers_on_two_hosts_sum_exactly_with_the_rings_across_hosts_on_lanes():
    # two workers on each of two hosts: the hierarchical allreduce sums within each host through
    # shared memory and runs its rings across the hosts' link, whose big segments take the lanes
    script = str(REPO / "tests" / "kvcore" / "allreduce_scripts" / "lane_sums.py")
    with NetnsCluster(nics=("eth0", "eth0")) as cluster:
        root = cluster.address("h1")
        with LocalJob(4, 0, start_scheduler=False, root_uri=root) as job:
            job.start("scheduler", 0, cluster.run_in("h1", [sys.executable, "-m", "psnode", "scheduler"]))
            for i, host in enumerate(("h1", "h1", "h2", "h2")):
                job.start("worker", i, cluster.run_in(host, [sys.executable, script]), {"DMLC_WORKER_ID": str(i)},
                          node_host=cluster.address(host))
            results = job.wait(120)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(map(str, failed))
    counts = [int(c) for r in results for c in re.findall(r"^OK \d+ lane messages (\d+)$", r.output, re.M)]
    assert len(counts) == 4 and min(counts) > 0, ("\n".join(map(str, results)), counts)


def test_workers_on_another_host_push_and_pull_big_values_on_data_lanes_and_sum_exactly():
    # the scheduler and both servers on h1, the workers on h2: every big push and pull reply crosses
    # the link on a data lane (psnode.node.data_lanes), after worker 0 sent each server's data lane port
    # a stranger's bytes
    script = str(REPO / "tests" / "kvcore" / "dist_scripts" / "data_lanes.py")
    with NetnsCluster(nics=("eth0", "eth0")) as cluster:
        root = cluster.address("h1")
        with LocalJob(2, 2, start_scheduler=False, start_servers=0, root_uri=root,
                      env={"PSLAUNCH_BIGARRAY_BOUND": "100000"}) as job:
            job.start("scheduler", 0, cluster.run_in("h1", [sys.executable, "-m", "psnode", "scheduler"]))
            for i in range(2):
                job.start("server", i, cluster.run_in("h1", [sys.executable, "-m", "psnode", "server"]),
                          node_host=root)
                job.start("worker", i, cluster.run_in("h2", [sys.executable, script]), {"DMLC_WORKER_ID": str(i)},
                          node_host=cluster.address("h2"))
            results = job.wait(120)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(map(str, failed))
    counts = [tuple(int(x) for x in m) for r in results
              for m in re.findall(r"^LANES (\d+) (\d+) (\d+) (\d+)$", r.output, re.M)]
    # copied pushes go from the caller's array when their lane is idle (its array changes right after)
    assert len(counts) == 2 and all(sent >= 12 and received >= 12 and in_place == received and through >= 1
                                    for sent, received, in_place, through in counts), counts


def test_the_capped_training_benchmark_trains_across_shaped_links_and_counts_the_bytes_that_cross(tmp_path):
    out = tmp_path / "training.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.capped_training", "--quick", "--models", "mlp", "--hidden",
                          "1024", "--configs", "uncompressed,topk 1% + bf16 pulls", "--rates", "200mbit", "--json",
                          str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {r["config"]: r for r in json.loads(out.read_text())["summary"]}
    assert sorted(rows) == ["topk 1% + bf16 pulls", "uncompressed"] and all(r["step_ms"] > 0 for r in rows.values())
    # what crossed the links: the model (64 x 1024 + 1024 x 10 floats) up and down per worker and step, then
    # a 1% push and a half-width pull
    model = 4 * (64 * 1024 + 1024 + 1024 * 10 + 10)
    assert rows["uncompressed"]["bytes_per_step"] > 2 * model
    assert rows["topk 1% + bf16 pulls"]["bytes_per_step"] < 0.45 * rows["uncompressed"]["bytes_per_step"]
    assert "| 200mbit | mlp | topk 1% + bf16 pulls |" in res.stdout
    png = tmp_path / "capped.png"  # the figure docs/training.md shows, from the same JSON
    drawn = subprocess.run([sys.executable, "-m", "benchmarks.plots", "capped", str(out), str(png)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert drawn.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", drawn.stderr


def test_the_ps_against_ring_benchmark_measures_each_design_beside_its_link_model_and_plots_it(tmp_path):
    out, png = tmp_path / "ps_vs_ring.json", tmp_path / "ps_vs_ring.png"
    res = subprocess.run([sys.executable, "-m", "benchmarks.ps_vs_ring", "--quick", "--json", str(out), "--plot", str(png)],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = {(e["design"], e["servers"]): e for e in json.loads(out.read_text())["summary"]}
    assert sorted(summary) == [("ps", 1), ("ps", 2), ("ring", 0)]
    assert all(e["seconds"] > 0 for e in summary.values())
    # one server host carries both workers' pushes and pulls: twice the link time of two server hosts
    assert summary[("ps", 1)]["model_s"] == 2 * summary[("ps", 2)]["model_s"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
