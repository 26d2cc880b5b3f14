"""The ssh backend: processes on the hostfile's hosts over paramiko, one channel each.

Before anything starts, every host is checked in parallel (``SshConnector.preflight``) and, with
``--sync-dst-dir``, the current directory is rsynced to each. Each remote process runs inside
``launcher.on_node.guard``: its environment arrives on the channel's stdin, and it dies with its group
when the channel closes — also when pslaunch is SIGKILLed — or when no ping from pslaunch came for
``--link-timeout`` (a partition); a host pslaunch hears nothing from for that long is lost
(``launcher.backends.ssh.linkwatch``). Processes placed on the launching host
(the scheduler, by default) are local children, as in the local backend.
"""

from __future__ import annotations

import threading

import paramiko

from ...errors import ConfigError, SpawnError
from ...on_node.guard import env_payload, remote_command
from ...planning.hostfile import Host
from ...planning.plan import Plan, ProcessSpec
from ..base import Backend, ExitStatus, GuardedHandle, ProcessHandle, pump
from ..checks.checkpoint_dir import check_checkpoint_dir
from ..checks.script import check_scripts_here, check_scripts_remote
from ..local import LocalSpawner
from .connection import SshConnector, resolve_over_ssh
from .linkwatch import LinkWatch, PongFilter
from .reach import check_plan_reachable
from .rsync import sync_all

__all__ = ["SshBackend", "SshHandle"]

# sshd's MaxSessions defaults to 10 channels per connection; stay below it.
_CHANNELS_PER_CONNECTION = 8


class SshHandle(GuardedHandle):
    """A process running under the remote guard on one paramiko channel; ``watch`` says whether
    its host is still heard from (``launcher.backends.ssh.linkwatch``)."""

    def __init__(self, spec: ProcessSpec, channel: paramiko.Channel, watch: LinkWatch) -> None:
        super().__init__(spec)
        self.channel = channel
        self.watch = watch
        self._lock = threading.Lock()

    def _poll(self) -> ExitStatus | None:
        transport = self.channel.get_transport()
        alive = transport is not None and transport.is_active()
        if self.channel.exit_status_ready():
            code = self.channel.recv_exit_status()
            if code >= 0:
                return ExitStatus(code=code)
            # -1: the channel closed without an exit status
            if alive:
                return ExitStatus(code=255, detail=f"no exit status from {self.spec.host.label}: "
                                                   "the remote guard was killed by a signal")
        elif not self.channel.closed and alive:
            if self.watch.lost(self.spec.host):
                return self._lost(f"no answer for {self.watch.timeout:g} s")
            return None
        return self._lost("its ssh connection dropped")

    def _lost(self, how: str) -> ExitStatus:  # type: ignore[override]
        return super()._lost(how, self.watch.last_heard(self.spec.host))

    def in_doubt(self) -> bool:
        return self.status is None and self.watch.in_doubt(self.spec.host)

    def signal_process(self, signum: int) -> bool:
        if self.status is not None or self.unreachable:
            return False
        self._tell(f"SIG {signum}")  # the guard signals the command alone (a Linux host's number)
        return True

    def _tell(self, verb: str) -> None:
        # a lost host gets nothing (``tell``): its guard stops the process itself after the link timeout
        self._send(verb.encode() + b"\n")

    def _send(self, data: bytes) -> None:
        with self._lock:
            try:
                if not self.channel.closed:
                    self.channel.sendall(data)
            except (OSError, EOFError, paramiko.SSHException):
                pass

    def close(self, timeout: float = 2.0) -> None:
        if self.unreachable:
            self.channel.close()  # no more output can come; the readers end at once
        for thread in self._threads:
            thread.join(timeout)
        self.channel.close()


class SshBackend(Backend):
    """Runs remote processes over ssh (``--launcher ssh``). Not thread-safe."""

    name = "ssh"

    @classmethod
    def resolve(cls, config):
        return resolve_over_ssh(config)

    @classmethod
    def configure(cls, config, environ):
        if not config.hosts:
            raise ConfigError("--launcher ssh needs -H/--hostfile naming the hosts")
        return config

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.connector = SshConnector(config)
        self.spawner = LocalSpawner(config.stop_grace)
        self.watch = LinkWatch(config.link_timeout)
        self._clients: dict[Host, list[list]] = {}  # host -> [[client, channels opened], ...]

    def prepare(self, plan: Plan) -> None:
        check_scripts_here([s for s in plan.processes if s.on_launcher], self.config.cwd)
        self._prepare_hosts(plan, plan.remote_hosts)
        check_plan_reachable(plan, {h: c[0][0] for h, c in self._clients.items()}, self.config, self.printer)

    def prepare_more(self, plan: Plan) -> None:
        known = {(h.user, h.name, h.port) for h in self._clients}
        self._prepare_hosts(plan, [h for h in plan.remote_hosts if (h.user, h.name, h.port) not in known])

    def _prepare_hosts(self, plan: Plan, hosts: list[Host]) -> None:
        """Pre-flight ``hosts``, rsync to them, check the scripts and checkpoint directory of ``plan``
        there (every host of ``plan`` must be prepared by now)."""
        if not hosts:
            return
        if self.config.verbose:
            self.printer.note(f"ssh pre-flight check of {len(hosts)} host(s)")
        for host, client in self.connector.preflight(hosts).items():
            self._clients[host] = [[client, 0]]
        clients = {h: c[0][0] for h, c in self._clients.items()}
        if self.config.sync_dst_dir:
            sync_all(self.connector, hosts, self.config.sync_src_dir, self.config.sync_dst_dir, clients,
                     self.printer, self.config)
        check_scripts_remote([s for s in plan.processes if not s.on_launcher and s.host in hosts], clients,
                             self.config.ssh.connect_timeout)
        check_checkpoint_dir(plan, self.config.checkpoint_dir, clients, self.config.ssh.connect_timeout)

    def _client_for(self, host: Host) -> paramiko.SSHClient:
        pool = self._clients.setdefault(host, [])
        for entry in pool:
            if entry[1] < _CHANNELS_PER_CONNECTION:
                entry[1] += 1
                return entry[0]
        client = self.connector.connect(host)
        pool.append([client, 1])
        return client

    def _start_remote(self, spec: ProcessSpec) -> SshHandle:
        try:
            client = self._client_for(spec.host)
            channel = client.get_transport().open_session(timeout=self.config.ssh.connect_timeout)  # type: ignore[union-attr]
            channel.exec_command(remote_command(spec.argv, spec.cwd, bool(self.config.sync_dst_dir), self.config.stop_grace,
                                                self.config.link_timeout))
            channel.sendall(env_payload(spec.full_env()))
        except Exception as exc:
            raise SpawnError(f"cannot start {spec.name} over ssh: {type(exc).__name__}: {exc}") from exc
        handle = SshHandle(spec, channel, self.watch)
        handle._threads = [
            pump(self._reader(spec.host, channel.recv), handle, "stdout", self.printer),
            pump(self._reader(spec.host, channel.recv_stderr, PongFilter()), handle, "stderr", self.printer),
        ]
        self.watch.add(spec.host, handle._send)
        return handle

    def _reader(self, host: Host, recv, pongs: PongFilter | None = None):
        """``recv`` for ``pump``: every chunk is word from ``host``; the guard's answers to pings are
        taken out (b"" only at the end of the stream)."""

        def read() -> bytes:
            while True:
                data = recv(1 << 20)
                if data:
                    self.watch.heard(host)
                if pongs is None:
                    return data
                text = pongs.feed(data)
                if text or not data:
                    return text

        return read

    def launch(self, plan: Plan) -> list[ProcessHandle]:
        handles: list[ProcessHandle] = []
        try:
            for spec in plan.processes:
                if spec.on_launcher:
                    handles.append(self.spawner.spawn(spec, self.printer))
                else:
                    handles.append(self._start_remote(spec))
        except Exception:
            for h in handles:
                h.kill()
            for h in handles:
                h.close(0.5)
            raise
        return handles

    def close(self) -> None:
        self.watch.close()
        self.spawner.close()
        for pool in self._clients.values():
            for client, _ in pool:
                client.close()
        self._clients.clear()
        self.connector.close()
