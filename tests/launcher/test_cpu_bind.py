"""``--cpu-bind none|cores|numa`` (``PSLAUNCH_CPU_BIND``): each process of the job is pinned to its
share of its machine's cores, every thread of it, under the local backend (pslaunch binds the child
as it starts) and over ssh (the runtime binds its own process when its node starts); mpi, the batch
schedulers and Ray bind their own and refuse it, naming their way."""

from __future__ import annotations

import os
import re
import sys

import pytest

from pscontract import binding
from psnode.env import read_env
from psnode.errors import EnvError
from testkit.launcher import REPO, run_pslaunch, wait_gone

pytestmark = pytest.mark.timeout(120)

SCRIPT = """import glob, os, sys
import kvcore
kv = kvcore.create("dist_sync")
masks = set()
for status in glob.glob("/proc/self/task/*/status"):
    with open(status) as fh:
        masks.update(line.split()[1] for line in fh if line.startswith("Cpus_allowed_list"))
print("AFFINITY", kv.rank, len(glob.glob("/proc/self/task/*")), ";".join(sorted(masks)), sys.argv[1], flush=True)
"""


def _masks(res) -> dict[int, tuple[int, set[str]]]:
    return {int(rank): (int(threads), set(masks.split(";")))
            for rank, threads, masks in re.findall(r"AFFINITY (\d) (\d+) (\S+)", res.stdout)}


def _expected(mode: str, index: int, count: int) -> str:
    usable = sorted(os.sched_getaffinity(0))
    return binding.cpu_list(binding.share(mode, index, count, usable, binding.numa_nodes()))


@pytest.mark.parametrize("mode", ["cores", "numa"])
def test_every_thread_of_each_local_process_runs_on_its_share_of_the_cores(tmp_path, mode, marker):
    script = tmp_path / "affinity.py"
    script.write_text(SCRIPT)
    res = run_pslaunch(["-n", "2", "-s", "1", "--no-dashboard", "--cpu-bind", mode, "python", str(script), marker],
                       timeout=90)
    assert res.returncode == 0, res.stderr
    seen = _masks(res)
    # the scheduler is process 0 of 4 on this machine, the server 1, the workers 2 and 3
    for rank in (0, 1):
        threads, masks = seen[rank]
        assert threads > 1 and masks == {_expected(mode, 2 + rank, 4)}, (rank, seen)
    assert not wait_gone(marker)


def test_without_the_option_nothing_is_bound(tmp_path, marker):
    script = tmp_path / "affinity.py"
    script.write_text(SCRIPT)
    res = run_pslaunch(["-n", "2", "-s", "1", "--no-dashboard", "python", str(script), marker], timeout=90)
    assert res.returncode == 0, res.stderr
    everything = binding.cpu_list(os.sched_getaffinity(0))
    assert all(masks == {everything} for _, masks in _masks(res).values()), res.stdout


def test_over_ssh_each_process_binds_itself_to_its_share_of_its_machines_cores(sshd, tmp_path, marker):
    script = tmp_path / "affinity.py"
    script.write_text(SCRIPT)
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    res = run_pslaunch(["-n", "2", "-s", "1", "-H", hosts, *sshd.ssh_flags(), "--no-dashboard", "--cpu-bind", "cores",
                        "--env", f"PYTHONPATH:{REPO}", "python", str(script), marker], timeout=90)
    assert res.returncode == 0, res.stderr
    seen = _masks(res)
    # loopback hosts share this machine's cores: scheduler, server, worker 0, worker 1 are 0..3 of 4
    assert seen[0][1] == {_expected("cores", 2, 4)} and seen[1][1] == {_expected("cores", 3, 4)}, seen
    assert not wait_gone(marker)


@pytest.mark.parametrize("launcher, message", [
    ("mpi", "--cpu-bind is not an option of --launcher mpi: mpirun binds the ranks itself: set "
            "OMPI_MCA_hwloc_base_binding_policy=core"),
    ("slurm", "--cpu-bind is not an option of --launcher slurm: the batch scheduler binds its tasks itself"),
    ("ray", "--cpu-bind is not an option of --launcher ray: Ray gives its actors CPUs"),
])
def test_backends_that_bind_their_own_processes_refuse_it_naming_their_way(tmp_path, launcher, message):
    res = run_pslaunch(["-n", "2", "--launcher", launcher, "--cpu-bind", "cores", "--dry-run", sys.executable, "x.py"],
                       timeout=30)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_shares_are_contiguous_blocks_as_even_as_they_can_be_and_numa_nodes_come_from_sys(tmp_path):
    assert [binding.share("cores", i, 3, range(8)) for i in range(3)] == [{0, 1, 2}, {3, 4, 5}, {6, 7}]
    assert [binding.share("cores", i, 3, [0, 1]) for i in range(3)] == [{0}, {1}, {0}]
    for node, cpus in enumerate(["0-3,8-11", "4-7,12-15"]):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    nodes = binding.numa_nodes(str(tmp_path))
    assert nodes == [{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}]
    assert [binding.cpu_list(binding.share("numa", i, 3, range(16), nodes)) for i in range(3)] == [
        "0-3,8-11", "4-7,12-15", "0-3,8-11"]
    assert binding.share("numa", 1, 2, [0, 1], []) == {0, 1}  # no NUMA information: one node


@pytest.mark.parametrize("value, message", [
    ("cores:2:2", "process 2 of 2 does not exist"),
    ("cores", "must be cores:I:N, numa:I:N or list:CPUS"),
    ("list:3-1", "'3-1' is not a list of CPUs"),
])
def test_a_bad_value_set_by_hand_is_refused_naming_it(value, message):
    environ = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
               "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "PSLAUNCH_CPU_BIND": value}
    with pytest.raises(EnvError, match=re.escape(f"PSLAUNCH_CPU_BIND={value!r} is not valid: ") + ".*"
                       + re.escape(message)):
        read_env(environ)
