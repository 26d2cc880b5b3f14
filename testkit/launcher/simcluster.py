"""The simulated cluster of the ``netns`` tests: hosts in network namespaces (``testkit.netns``),
each with its own sshd, reached through an ssh config file as a real cluster's hosts are."""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from pathlib import Path

import pytest

from .sshd import start_sshd

__all__ = ["SimCluster", "start_cluster"]


@dataclass
class SimCluster:
    """Hosts ``node1``...``node3`` in network namespaces (``testkit.netns``), each with its own sshd
    on port 22, reached by the aliases of an ssh config file (``HostName``, ``User``, ``IdentityFile``)."""

    net: "object"  # testkit.netns.NetnsCluster
    key: str
    known_hosts: str
    ssh_config: str
    dir: Path

    ALIASES = ("node1", "node2", "node3")

    def host_of(self, alias: str) -> str:
        """The namespace host (``h1``...) behind ``alias``."""
        return self.net.hosts[self.ALIASES.index(alias)]

    def hostfile(self, name: str, lines: list[str]) -> str:
        """Write a hostfile with ``lines`` in the cluster's directory and return its path."""
        path = self.dir / name
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def ssh_flags(self) -> list[str]:
        """pslaunch flags that reach the cluster (the ssh config holds the rest, as on a real one)."""
        return ["--ssh-config", self.ssh_config, "--known-hosts", self.known_hosts]


def start_cluster(d: Path):
    """Generator: the simulated cluster (three namespaces, a compute-only second network, an sshd
    in each), yielded once every sshd answers; everything is removed afterwards, also on failure."""
    from contextlib import ExitStack

    from testkit.netns import NetnsCluster, usable

    why = usable()
    if why is not None:
        pytest.fail(f"the simulated cluster cannot be made here: {why}")
    with ExitStack() as stack:
        net = stack.enter_context(NetnsCluster(nics=("eth0", "ens5", "eth0"), compute=True))
        key = None
        for index, host in enumerate(net.hosts):
            sub = d / host
            sub.mkdir()
            gen = start_sshd(sub, (net.address(host), net.address(host, "compute")), authorized_key=key,
                             prefix=tuple(net.run_in(host, [], hostname=True)), port=22, reachable=(net.address(host),))
            first = next(gen)
            stack.callback(_finish, gen)
            if key is None:
                key = (sub / "id_user.pub").read_text()
                identity = first.key
        config = d / "ssh_config"
        config.write_text("".join(
            f"Host {alias}\n    HostName {net.address(host)}\n    User {getpass.getuser()}\n    IdentityFile {identity}\n"
            for alias, host in zip(SimCluster.ALIASES, net.hosts)))
        yield SimCluster(net, identity, str(d / "known_hosts"), str(config), d)


def _finish(gen) -> None:
    """Run a started ``start_sshd`` generator to its end (it stops its sshd)."""
    for _ in gen:
        pass
