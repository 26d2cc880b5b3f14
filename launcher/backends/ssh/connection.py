"""ssh connections for the ssh backend and rsync: options, host keys, the pre-flight check.

What decides how a host is reached, strongest first: the hostfile line (``user@host:port``), the
flags (``--ssh-user``, ``--ssh-port``, ``-i``), then ``~/.ssh/config`` (``HostName``, ``User``,
``Port``, ``IdentityFile``, ``ProxyCommand``, ``ProxyJump``), then ssh's defaults. The ssh agent
and the default keys are tried as OpenSSH would.

``ProxyJump`` (bastion hosts, common in front of clusters) is followed with paramiko itself: each
hop is reached like any host (its own ``~/.ssh/config`` entry, the same keys and host-key policy),
and the next connection runs inside a ``direct-tcpip`` channel of the previous one, as
``ssh -J`` does. (fabric's ``Connection(gateway=...)`` does the same over paramiko, but would be a
second place deciding users, keys and host-key policy for the same connections.)

Host keys (``--host-key-policy``): ``accept-new`` (default) trusts keys already in the known-hosts
file, records unknown ones there, and refuses a key that changed; ``strict`` refuses unknown keys;
``ignore`` checks nothing (throw-away clusters only). rsync's ssh gets the same policy and file.

paramiko is imported here only, and only when the ssh backend is used.
"""

from __future__ import annotations

import getpass
import os
import shlex
import socket
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import paramiko

from ...config import LaunchConfig
from ...errors import PreflightError
from ...planning.hostfile import Host, parse_hostfile_text
from ...planning.network import resolve

__all__ = ["Endpoint", "SshConnector", "JumpError", "describe_connect_error", "find_known_host", "real_names",
           "resolve_over_ssh"]

_known_hosts_lock = threading.Lock()


@dataclass(frozen=True)
class Endpoint:
    """Where and as whom to connect for a ``Host``, after hostfile, flags and ~/.ssh/config."""

    host: Host
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    proxy_command: str | None
    proxy_jump: str | None = None

    @property
    def label(self) -> str:
        """``user@host:port`` for messages."""
        return f"{self.user}@{self.host.label}:{self.port}"


class JumpError(Exception):
    """A ``ProxyJump`` bastion could not be reached or could not reach the next hop; the message says
    which and why."""


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Record an unknown host key in the known-hosts file and go on (OpenSSH's accept-new)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def missing_host_key(self, client, hostname, key) -> None:  # noqa: D102
        with _known_hosts_lock:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            with open(self.path, "a", encoding="ascii") as fh:
                fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class _Ignore(paramiko.MissingHostKeyPolicy):
    """Accept any key without recording it (``--host-key-policy ignore``)."""

    def missing_host_key(self, client, hostname, key) -> None:  # noqa: D102
        return


class SshConnector:
    """Opens paramiko clients to hosts with the job's ssh options. Thread-safe."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        path = os.path.expanduser(config.ssh.config or "~/.ssh/config")
        self.ssh_config_path = path if os.path.exists(path) else None
        self._ssh_config = paramiko.SSHConfig.from_path(path) if self.ssh_config_path else paramiko.SSHConfig()
        self.known_hosts = os.path.expanduser(config.ssh.known_hosts or "~/.ssh/known_hosts")
        self._jumps: list[paramiko.SSHClient] = []  # clients to bastion hosts, closed by close()

    def _configure(self, client: paramiko.SSHClient) -> None:
        """Known hosts and the missing-key policy of ``--host-key-policy``."""
        policy = self.config.ssh.host_key_policy
        if policy != "ignore":
            client.load_system_host_keys()
            if os.path.exists(self.known_hosts):
                client.get_host_keys().load(self.known_hosts)
        client.set_missing_host_key_policy(
            _AcceptNew(self.known_hosts) if policy == "accept-new" else _Ignore() if policy == "ignore" else paramiko.RejectPolicy()
        )

    def endpoint(self, host: Host) -> Endpoint:
        """Resolve how ``host`` is reached (see the module docstring for the precedence)."""
        found = self._ssh_config.lookup(host.name)
        port = host.port or self.config.ssh.port or int(found.get("port", 22))
        user = host.user or self.config.ssh.user or found.get("user") or getpass.getuser()
        keys: tuple[str, ...] = ()
        if self.config.ssh.identity:
            keys = (self.config.ssh.identity,)
        elif "identityfile" in found:
            keys = tuple(os.path.expanduser(k) for k in found["identityfile"] if os.path.exists(os.path.expanduser(k)))
        jump = found.get("proxyjump")
        command = found.get("proxycommand")
        return Endpoint(host, found.get("hostname", host.name), port, user, keys,
                        None if command in (None, "none") else command, None if jump in (None, "none") else jump)

    def connect(self, host: Host, timeout: float | None = None) -> paramiko.SSHClient:
        """Open an authenticated client to ``host``. Raises paramiko / socket errors (see
        ``describe_connect_error``) and ``JumpError``. Blocks up to about ``timeout`` seconds per hop
        (default --connect-timeout)."""
        return self._open(self.endpoint(host), self.config.ssh.connect_timeout if timeout is None else timeout, 0)

    def _open(self, ep: Endpoint, timeout: float, depth: int) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        self._configure(client)
        sock = None
        if ep.proxy_command:
            sock = paramiko.ProxyCommand(ep.proxy_command)
        elif ep.proxy_jump:
            sock = self._through_jumps(ep, timeout, depth)
        try:
            client.connect(
                ep.hostname,
                port=ep.port,
                username=ep.user,
                key_filename=list(ep.key_files) or None,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                sock=sock,
                allow_agent=True,
                look_for_keys=not ep.key_files,
            )
        except BaseException:
            client.close()
            raise
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(5)
        return client

    def _through_jumps(self, ep: Endpoint, timeout: float, depth: int) -> paramiko.Channel:
        """A channel to ``ep`` from its last ``ProxyJump`` host, itself reached through the ones
        before it (``a,b``: a first, then b), as ``ssh -J`` does."""
        if depth > 8:
            raise JumpError(f"ProxyJump of {ep.host.label} loops (more than 8 hops)")
        *before, last = ep.proxy_jump.split(",")  # type: ignore[union-attr]
        hop = self.endpoint(parse_hostfile_text(last, f"ProxyJump of {ep.host.label}")[0])
        if before:
            hop = replace(hop, proxy_command=None, proxy_jump=",".join(before))
        try:
            client = self._open(hop, timeout, depth + 1)
        except JumpError:
            raise
        except Exception as exc:
            raise JumpError(f"bastion {hop.label} (ProxyJump): {describe_connect_error(exc, hop, self.config)}") from exc
        self._jumps.append(client)
        try:
            return client.get_transport().open_channel(  # type: ignore[union-attr]
                "direct-tcpip", (ep.hostname, ep.port), ("127.0.0.1", 0), timeout=timeout)
        except Exception as exc:
            raise JumpError(f"bastion {hop.label} (ProxyJump) cannot reach {ep.hostname}:{ep.port}: {exc}") from exc

    def close(self) -> None:
        """Close the connections to bastion hosts (the clients ``connect`` returned are the caller's)."""
        for client in self._jumps:
            client.close()
        self._jumps.clear()

    def check(self, host: Host) -> paramiko.SSHClient:
        """Connect to ``host`` and run ``true`` there; returns the open client. Raises ``PreflightError``
        with one line naming the host and what went wrong."""
        ep = self.endpoint(host)
        try:
            client = self.connect(host)
        except JumpError as exc:
            raise PreflightError(f"{ep.label}: {exc}") from exc
        except Exception as exc:  # every failure becomes one line naming the host
            raise PreflightError(f"{ep.label}: {describe_connect_error(exc, ep, self.config)}") from exc
        try:
            code = run_remote(client, "true", self.config.ssh.connect_timeout)
        except Exception as exc:
            client.close()
            raise PreflightError(f"{ep.label}: connected, but cannot run a command: {exc}") from exc
        if code != 0:
            client.close()
            raise PreflightError(f"{ep.label}: connected, but `true` exited with {code} (login shell broken?)")
        return client

    def preflight(self, hosts: list[Host]) -> dict[Host, paramiko.SSHClient]:
        """Check every host in parallel; returns their open clients. Raises ``PreflightError`` with
        one line per failing host (and closes the clients that did open)."""
        if not hosts:
            return {}
        with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
            futures = {host: pool.submit(self.check, host) for host in hosts}
        clients, problems = {}, []
        for host, fut in futures.items():
            exc = fut.exception()
            if exc is None:
                clients[host] = fut.result()
            else:
                problems.append(str(exc))
        if problems:
            for client in clients.values():
                client.close()
            raise PreflightError(
                f"{len(problems)} of {len(hosts)} host(s) failed the ssh pre-flight check:\n  " + "\n  ".join(problems)
            )
        return clients

    def ssh_argv(self, host: Host) -> list[str]:
        """An OpenSSH command line (without the destination) with the same options, for rsync's ``-e``."""
        ep = self.endpoint(host)
        argv = ["ssh", "-p", str(ep.port), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(self.config.ssh.connect_timeout)}"]
        if self.ssh_config_path:  # the file read here ($HOME's), not the one of the passwd home directory
            argv += ["-F", self.ssh_config_path]
        for key in ep.key_files:
            argv += ["-i", key]
        strict = {"accept-new": "accept-new", "strict": "yes", "ignore": "no"}[self.config.ssh.host_key_policy]
        argv += ["-o", f"StrictHostKeyChecking={strict}"]
        if self.config.ssh.host_key_policy == "ignore":
            argv += ["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        else:
            argv += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        return argv

    def openssh_config(self, hosts: list[Host], extra: dict[str, str]) -> str:
        """An OpenSSH client config that reaches each of ``hosts`` by its name exactly as this
        connector does (host name, port, user, keys, proxy, known-hosts file and policy), for a
        program that runs ``ssh HOST`` itself (mpirun): with ``-F`` it reads this instead of the
        passwd home directory's config, which differs from ``$HOME``'s under ``sudo -E`` or in
        containers. ``extra``: options for every host. The ssh config read here follows, for the rest."""
        strict = {"accept-new": "accept-new", "strict": "yes", "ignore": "no"}[self.config.ssh.host_key_policy]
        known = "/dev/null" if self.config.ssh.host_key_policy == "ignore" else self.known_hosts
        common = {"BatchMode": "yes", "StrictHostKeyChecking": strict, "UserKnownHostsFile": known, **extra}
        keys = [os.path.expanduser(f"~/.ssh/{n}") for n in ("id_ed25519", "id_ecdsa", "id_rsa")]
        lines = []
        for host in dict.fromkeys(hosts):
            ep = self.endpoint(host)
            options = {"HostName": ep.hostname, "Port": str(ep.port), "User": ep.user, **common}
            if ep.proxy_command:
                options["ProxyCommand"] = ep.proxy_command
            elif ep.proxy_jump:
                options["ProxyJump"] = ep.proxy_jump
            lines.append(f"Host {host.name}")
            lines += [f"    {name} {value}" for name, value in options.items()]
            lines += [f"    IdentityFile {key}" for key in (ep.key_files or [k for k in keys if os.path.exists(k)])]
        if self.ssh_config_path:
            lines += ["Match all", f"    Include {self.ssh_config_path}"]
        return "\n".join(lines) + "\n"

    def write_openssh_config(self, hosts: list[Host]) -> str:
        """Write ``openssh_config`` for ``hosts`` to a file in a private temporary directory (the
        caller removes it) and return its path. ssh keepalives end such an ssh within about
        ``--link-timeout`` when its link is gone (a partition closes no connection by itself)."""
        extra = {"ConnectTimeout": str(max(1, int(self.config.ssh.connect_timeout))), "LogLevel": "ERROR"}
        if self.config.link_timeout > 0:
            extra.update(ServerAliveInterval=str(max(1, round(self.config.link_timeout / 3))), ServerAliveCountMax="3")
        path = os.path.join(tempfile.mkdtemp(prefix="pslaunch-ssh-"), "config")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as fh:
            fh.write(self.openssh_config(hosts, extra))
        return path

    def destination(self, host: Host) -> str:
        """``user@hostname`` as OpenSSH and rsync want it (IPv6 in brackets for rsync paths)."""
        ep = self.endpoint(host)
        name = f"[{ep.hostname}]" if ":" in ep.hostname else ep.hostname
        return f"{ep.user}@{name}"


def real_names(config: LaunchConfig, extra: str | None = None) -> list[tuple[str, str]]:
    """``(label, name ssh connects to)`` for each host of ``config`` (and ``extra``, a host name, last):
    ssh config's ``HostName`` of an alias, else the name itself. Reads the ssh config; connects nowhere."""
    connector = SshConnector(config)
    hosts = list(config.hosts) + ([Host(extra)] if extra else [])
    return [(host.name, connector.endpoint(host).hostname) for host in hosts]


def resolve_over_ssh(config: LaunchConfig) -> LaunchConfig:
    """``launcher.planning.network.resolve`` with the names ssh reaches the hosts by (its config's
    ``HostName`` of an alias), for the backends that reach hosts over ssh."""
    names = real_names(config, extra=config.scheduler_host) if config.hosts else None
    return resolve(config, real_names=names)


def run_remote(client: paramiko.SSHClient, command: str, timeout: float) -> int:
    """Run a short ``command`` (already shell-quoted) and return its exit status; output is dropped.
    Raises ``TimeoutError`` after ``timeout`` seconds."""
    chan = client.get_transport().open_session(timeout=timeout)  # type: ignore[union-attr]
    try:
        chan.settimeout(timeout)
        chan.exec_command(command)
        chan.shutdown_write()
        if not chan.status_event.wait(timeout):
            raise TimeoutError(f"{command!r} did not finish within {timeout:g} s")
        return chan.recv_exit_status()
    finally:
        chan.close()


def run_remote_output(client: paramiko.SSHClient, argv: list[str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` (quoted here) and return (exit status, stderr text)."""
    chan = client.get_transport().open_session(timeout=timeout)  # type: ignore[union-attr]
    try:
        chan.settimeout(timeout)
        chan.exec_command(shlex.join(argv))
        chan.shutdown_write()
        err = b""
        while True:
            data = chan.recv_stderr(65536)
            if not data:
                break
            err += data
        if not chan.status_event.wait(timeout):
            raise TimeoutError(f"{shlex.join(argv)!r} did not finish within {timeout:g} s")
        return chan.recv_exit_status(), err.decode("utf-8", "replace").strip()
    finally:
        chan.close()


def describe_connect_error(exc: BaseException, ep: Endpoint, config: LaunchConfig) -> str:
    """One sentence saying why connecting to ``ep`` failed, with a hint what to do."""
    if isinstance(exc, paramiko.BadHostKeyException):
        return _changed_key_message(exc, ep, config)
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(ep.key_files) or "ssh agent and default keys"
        return f"authentication failed for user {ep.user!r} (tried {keys}); check -i/--identity, --ssh-user, ~/.ssh/config"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return f"connection refused on port {ep.port} (is sshd running there? is the port right?)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"unreachable: no answer on port {ep.port} within {config.ssh.connect_timeout:g} s"
    if isinstance(exc, socket.gaierror):
        return f"unknown host name {ep.hostname!r} ({exc.strerror})"
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused on port {ep.port} (is sshd running there? is the port right?)"
    if isinstance(exc, OSError):
        return f"unreachable: {exc.strerror or exc}"
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "not found in known_hosts" in text:
            return f"unknown host key and --host-key-policy strict; add it to {os.path.expanduser(config.ssh.known_hosts or '~/.ssh/known_hosts')}"
        return f"ssh error: {text}"
    return f"{type(exc).__name__}: {exc}"


def _known_name(ep: Endpoint) -> str:
    """How known_hosts names the host: ``host``, or ``[host]:port`` off port 22."""
    return ep.hostname if ep.port == 22 else f"[{ep.hostname}]:{ep.port}"


def find_known_host(path: str, name: str) -> int | None:
    """The 1-based line of ``path`` (a known_hosts file) holding a key for ``name`` (also hashed)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for number, line in enumerate(lines, start=1):
        fields = line.split()
        if not fields or line.lstrip().startswith("#"):
            continue
        for entry in fields[0].split(","):
            if entry == name or (entry.startswith("|1|") and paramiko.HostKeys.hash_host(name, entry) == entry):
                return number
    return None


def _changed_key_message(exc: paramiko.BadHostKeyException, ep: Endpoint, config: LaunchConfig) -> str:
    name = _known_name(ep)
    got = f"{exc.key.get_name()} {exc.key.fingerprint}"
    files = [os.path.expanduser(config.ssh.known_hosts or "~/.ssh/known_hosts"), os.path.expanduser("~/.ssh/known_hosts")]
    for path in dict.fromkeys(files):
        line = find_known_host(path, name)
        if line is not None:
            return (f"host key CHANGED: the host offers {got}, but {path} line {line} holds another key for "
                    f"{name}. If the host was reinstalled, remove that line (ssh-keygen -R {shlex.quote(name)} "
                    f"-f {shlex.quote(path)}) and run again; otherwise someone may be intercepting the connection")
    return (f"host key CHANGED: the host offers {got}, but the known hosts hold another key for {name}; if the "
            f"host was reinstalled, remove it (ssh-keygen -R {shlex.quote(name)}) and run again")
