"""The test sshd: a real OpenSSH server on loopback addresses, with its own keys."""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.processes import reap

__all__ = ["Sshd", "start_sshd", "LOOPBACK_HOSTS"]

LOOPBACK_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def _free_port_on_all(addresses) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        try:
            for addr in addresses[1:]:
                with socket.socket() as s:
                    s.bind((addr, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


@dataclass
class Sshd:
    """A running test sshd: where it listens and the key that logs in."""

    port: int
    key: str
    known_hosts: str
    user: str
    dir: Path

    def hostfile(self, path: Path, lines: list[str]) -> str:
        """Write a hostfile with ``lines`` and return its path."""
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def ssh_flags(self) -> list[str]:
        """pslaunch flags that reach this sshd."""
        return ["--ssh-port", str(self.port), "-i", self.key, "--known-hosts", self.known_hosts,
                "--ssh-config", str(self.dir / "no_ssh_config")]


def start_sshd(d: Path, hosts: tuple[str, ...] = LOOPBACK_HOSTS, log_level: str = "ERROR",
               authorized_key: str | None = None, prefix: tuple[str, ...] = (), port: int | None = None,
               reachable: tuple[str, ...] | None = None):
    """Generator: start a real OpenSSH server on ``hosts`` with keys in ``d``, yield it, stop it.

    ``authorized_key`` (a public key line) logs in instead of the server's own ``id_user`` key;
    ``log_level`` is sshd's (its log is ``d / "sshd.log"``); ``prefix`` goes before sshd's argv (to
    start it in a network namespace); ``port`` is a fixed port instead of a free one; ``reachable``
    the addresses of ``hosts`` this process can reach to see it listen (default: all).
    """
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.fail("/usr/sbin/sshd is missing: run scripts/test.sh (it installs openssh-server)")
    for name in ("host_key", "id_user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True, timeout=30)
    (d / "authorized_keys").write_text(authorized_key or (d / "id_user.pub").read_text())
    port = port or _free_port_on_all(hosts)
    listen = "\n".join(f"ListenAddress {h}" for h in hosts)
    (d / "sshd_config").write_text(f"""Port {port}
{listen}
HostKey {d / 'host_key'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile {d / 'authorized_keys'}
PermitRootLogin yes
StrictModes no
UsePAM no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
MaxSessions 30
MaxStartups 100
Subsystem sftp internal-sftp
LogLevel {log_level}
""")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    (d / "no_ssh_config").write_text("")
    proc = subprocess.Popen([*prefix, "/usr/sbin/sshd", "-D", "-f", str(d / "sshd_config"), "-e"],
                            stdout=subprocess.DEVNULL, stderr=open(d / "sshd.log", "wb"), start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        pending = list(hosts if reachable is None else reachable)
        while pending:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited with {proc.returncode}: {(d / 'sshd.log').read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"sshd did not listen on {pending} port {port} within 15 s")
            try:
                with socket.create_connection((pending[0], port), timeout=1):
                    pending.pop(0)
            except OSError:
                time.sleep(0.1)
        yield Sshd(port, str(d / "id_user"), str(d / "known_hosts"), getpass.getuser(), d)
    finally:
        reap([proc], grace=10)
