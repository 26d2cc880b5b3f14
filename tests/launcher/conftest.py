"""Fixtures for the launcher tests: a real sshd on loopback, real batch clusters, process markers.

``sshd`` starts OpenSSH's server on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (distinct hosts for the
launcher) on a free port, with keys made in a temporary directory, and stops it afterwards. It
needs /usr/sbin/sshd (``scripts/test.sh`` installs openssh-server); CI runs as root.

``slurm`` and ``sge`` start a one-machine Slurm or SGE cluster (controller and node daemons) in a
temporary directory, once per test session, touching nothing in /etc; their clients find them
through the environment the fixture gives (``SLURM_CONF``; ``SGE_ROOT``, ``SGE_CELL`` and ports).
Every daemon, and every process they started, is stopped afterwards, also when a test failed.
"""

from __future__ import annotations

import uuid
import warnings

import pytest

from testkit.launcher import Cluster, SimCluster, Sshd, start_cluster, start_sge, start_slurm, start_sshd


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Sshd:
    """A real OpenSSH server on 127.0.0.1-3 for the whole session; stopped afterwards."""
    yield from start_sshd(tmp_path_factory.mktemp("sshd"))


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Cluster:
    """A real one-machine Slurm cluster (slurmctld + slurmd) for the whole session."""
    yield from start_slurm(tmp_path_factory.mktemp("slurm"))


@pytest.fixture
def slurm(slurm_cluster: Cluster) -> Cluster:
    """The session's Slurm cluster, its node in service: one an earlier test left drained is
    resumed first, with a warning that says why it was drained."""
    was = slurm_cluster.back_in_service()
    if was is not None:
        warnings.warn(f"the Slurm node was {was}; resumed it for this test")
    return slurm_cluster


@pytest.fixture(scope="session")
def sge(tmp_path_factory) -> Cluster:
    """A real one-machine SGE cluster (sge_qmaster + sge_execd) for the whole session."""
    yield from start_sge(tmp_path_factory.mktemp("sge"))


@pytest.fixture
def marker() -> str:
    """A unique string to put on test processes' command lines, to find leftovers by."""
    return f"pslaunch-test-{uuid.uuid4().hex[:10]}"




@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> SimCluster:
    """Three hosts in network namespaces with their own sshd (marked ``netns``); removed afterwards."""
    yield from start_cluster(tmp_path_factory.mktemp("cluster"))
