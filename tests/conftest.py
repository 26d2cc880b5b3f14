"""The suite's tiers (docs/testing.md): which tests start daemons, and a unit tier that cannot start a process.

- ``unit``: in-process tests, marked per module (``pytestmark = pytest.mark.unit``) or per test. While
  one runs, starting a process (``subprocess``, ``os.fork``, ``os.posix_spawn``) fails it, so the tier
  stays what ``pytest -m unit`` promises.
- ``ssh``, ``mpi``, ``slurm``, ``sge``: the groups that need a daemon or a launcher of the system, found
  from what a test uses (the ``sshd``, ``slurm`` or ``sge`` fixture, or a parameter naming one, as
  ``backend`` does), so a test parametrized over every backend lands in each group by its own
  parameter; ``mpi`` and ``netns`` are also marked by their modules and tests. ``pytest -m slurm``
  runs one group alone.
- Under pytest-xdist (``-n``), each group that starts a session-wide cluster (Slurm, SGE, the
  simulated network-namespace cluster, the Ray cluster of ``ray``) runs on one xdist worker
  (``--dist loadgroup``), so the cluster is started once and no two of them share the machine's
  daemons' names.
"""

from __future__ import annotations

import os
import subprocess

import pytest

DAEMON_GROUPS = ("ssh", "mpi", "slurm", "sge")
_FIXTURE_GROUPS = {"sshd": "ssh", "slurm": "slurm", "sge": "sge"}
#: groups whose session fixture is a whole cluster: one xdist worker runs each
_ONE_WORKER = ("slurm", "sge", "netns", "ray")


def _groups(item: pytest.Item) -> set[str]:
    found = {group for name, group in _FIXTURE_GROUPS.items() if name in getattr(item, "fixturenames", ())}
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        found |= {value for value in callspec.params.values() if isinstance(value, str) and value in DAEMON_GROUPS}
    found |= {group for group in (*DAEMON_GROUPS, "netns", "ray") if item.get_closest_marker(group) is not None}
    return found


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads xdist_group to place each test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        groups = _groups(item)
        for group in sorted(groups):
            item.add_marker(getattr(pytest.mark, group))
        if item.get_closest_marker("unit") is not None and groups:
            raise pytest.UsageError(f"{item.nodeid} is marked unit but needs {', '.join(sorted(groups))}")
        together = [g for g in _ONE_WORKER if g in groups]
        if together:
            item.add_marker(pytest.mark.xdist_group(together[0]))


class ProcessStarted(AssertionError):
    """A unit test started a process."""


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(*args, **kwargs):
        raise ProcessStarted(f"{request.node.nodeid} is marked unit, which starts no process; "
                             "move it to another tier or drop the process")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(os, "posix_spawnp", refuse)
    yield
