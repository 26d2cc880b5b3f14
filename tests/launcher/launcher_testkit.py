"""Helpers shared by the launcher tests: the test sshd, pslaunch runs, process checks.

A module with its own name (not ``conftest``) so that ``from launcher_testkit import ...`` cannot
pick up another directory's conftest.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

HELPERS = Path(__file__).parent / "helpers"
REPO = Path(__file__).resolve().parents[2]
LOOPBACK_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
PSLAUNCH = [sys.executable, "-m", "launcher.cli"]


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
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ancestors(pid: int) -> list[int]:
    """The parent, grandparent, ... of ``pid`` up to init, from /proc."""
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            break
        chain.append(pid)
    return chain


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def processes_with(text: str) -> list[str]:
    """Command lines of live (non-zombie) processes whose argv contains ``text``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != b"Z":
            found.append(f"{entry}: {cmd}")
    return found


def wait_gone(text: str, timeout: float = 10.0) -> list[str]:
    """Wait until no process carries ``text``; returns what is left after ``timeout`` (empty = gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with(text)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@dataclass
class Result:
    """A finished pslaunch run."""

    returncode: int
    stdout: str
    stderr: str


def start_pslaunch(args: list[str], cwd: str | None = None, env: dict | None = None) -> subprocess.Popen:
    """Start pslaunch with ``args`` in the background, in its own process group, its output piped.

    ``env`` (default: this process's environment) gets the repository put first on PYTHONPATH.
    The caller reaps it: see :func:`reaped`.
    """
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.Popen(PSLAUNCH + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=full_env, start_new_session=True)


def wait_for_records(out: Path, count: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Wait until ``count`` role.py records (``*.json``) stand in ``out``: the job's processes started.

    Fails at once, with pslaunch's output, if pslaunch ends first, and after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while len(list(out.glob("*.json"))) < count:
        if proc.poll() is not None:
            raise AssertionError(f"pslaunch ended early: {proc.communicate()}")
        assert time.monotonic() < deadline, "the job's processes did not start"
        time.sleep(0.05)


@contextmanager
def reaped(proc: subprocess.Popen, marker: str):
    """Yield ``proc``; afterwards, pass or fail, kill its process group if it still runs and
    SIGKILL every process still carrying ``marker``, so that a failing test leaves nothing behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for line in processes_with(marker):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def run_pslaunch(args: list[str], timeout: float = 60, cwd: str | None = None, env: dict | None = None) -> Result:
    """Run pslaunch with ``args`` in a fresh process (its own group, killed on timeout)."""
    proc = start_pslaunch(args, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"pslaunch {args} did not finish within {timeout} s:\n{out.decode()}\n{err.decode()}") from None
    return Result(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def helper(name: str) -> str:
    """Path of a helper script in tests/launcher/helpers."""
    return str(HELPERS / name)


@dataclass
class SimCluster:
    """Hosts ``node1``...``node3`` in network namespaces (``benchmarks.netns``), each with its own sshd
    on port 22, reached by the aliases of an ssh config file (``HostName``, ``User``, ``IdentityFile``)."""

    net: "object"  # benchmarks.netns.NetnsCluster
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

    from benchmarks.netns import NetnsCluster, usable

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
