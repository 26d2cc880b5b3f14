"""The launcher tests' kit: pslaunch runs and process checks (``processes``), the test sshd
(``sshd``), the simulated cluster of network namespaces (``simcluster``), one-machine Slurm and SGE clusters (``clusters``), and how a test runs pslaunch on each
backend (``backends``).

A package with its own name (not ``conftest``) so that ``from testkit.launcher import ...`` cannot
pick up another directory's conftest.
"""

from .backends import BATCH_BACKENDS, Launch, backend_launch
from .clusters import Cluster, start_sge, start_slurm
from .processes import (
    HELPERS,
    PSLAUNCH,
    REPO,
    LiveProcess,
    Result,
    ancestors,
    cmdline,
    helper,
    job_server,
    job_worker,
    live_processes,
    processes_with,
    reaped,
    run_pslaunch,
    start_pslaunch,
    wait_for_records,
    wait_gone,
)
from .simcluster import SimCluster, start_cluster
from .sshd import LOOPBACK_HOSTS, Sshd, start_sshd

__all__ = ["HELPERS", "PSLAUNCH", "REPO", "LiveProcess", "Result", "ancestors", "cmdline", "helper", "job_server", "job_worker",
           "live_processes", "processes_with", "reaped",
           "run_pslaunch", "start_pslaunch", "wait_for_records", "wait_gone", "LOOPBACK_HOSTS", "Sshd", "start_sshd",
           "SimCluster", "start_cluster", "Cluster", "start_sge", "start_slurm", "BATCH_BACKENDS", "Launch", "backend_launch"]
