"""The ssh backend: processes on the hostfile's hosts over paramiko, one channel each.

Before anything starts, every host is checked in parallel (``SshConnector.preflight``) and, with
``--sync-dst-dir``, the current directory is rsynced to each. Each remote process runs inside
``launcher.guard``: its environment arrives on the channel's stdin, and it dies with its group
when the channel closes — also when pslaunch is SIGKILLed. Processes placed on the launching host
(the scheduler, by default) are local children, as in the local backend.
"""

from __future__ import annotations

import threading

import paramiko

from ..errors import SpawnError
from ..guard import env_payload, remote_command
from ..hostfile import Host
from ..plan import Plan, ProcessSpec
from ..rsync import sync_all
from ..sshconn import SshConnector
from .base import Backend, ExitStatus, ProcessHandle, pump
from .local import LocalSpawner

__all__ = ["SshBackend", "SshHandle"]

# sshd's MaxSessions defaults to 10 channels per connection; stay below it.
_CHANNELS_PER_CONNECTION = 8


class SshHandle(ProcessHandle):
    """A process running under the remote guard on one paramiko channel."""

    def __init__(self, spec: ProcessSpec, channel: paramiko.Channel) -> None:
        super().__init__(spec)
        self.channel = channel
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def on_marker(self, text: str) -> None:
        """Control lines from the guard: ``PID n``."""
        verb, _, arg = text.strip().partition(" ")
        if verb == "PID" and arg.isdigit():
            self.pid = int(arg)

    def _poll(self) -> ExitStatus | None:
        if self.channel.exit_status_ready():
            return ExitStatus(code=self.channel.recv_exit_status())
        transport = self.channel.get_transport()
        if self.channel.closed or transport is None or not transport.is_active():
            if self.channel.exit_status_ready():
                return ExitStatus(code=self.channel.recv_exit_status())
            return ExitStatus(code=255, detail="ssh connection lost")
        return None

    def _send(self, data: bytes) -> None:
        with self._lock:
            try:
                if not self.channel.closed:
                    self.channel.sendall(data)
            except (OSError, EOFError, paramiko.SSHException):
                pass

    def terminate(self) -> None:
        self._send(b"TERM\n")

    def kill(self) -> None:
        self._send(b"KILL\n")

    def close(self, timeout: float = 2.0) -> None:
        for thread in self._threads:
            thread.join(timeout)
        self.channel.close()


class SshBackend(Backend):
    """Runs remote processes over ssh (``--launcher ssh``). Not thread-safe."""

    name = "ssh"

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.connector = SshConnector(config)
        self.spawner = LocalSpawner(config.stop_grace)
        self._clients: dict[Host, list[list]] = {}  # host -> [[client, channels opened], ...]

    def prepare(self, plan: Plan) -> None:
        hosts = plan.remote_hosts
        if self.config.verbose:
            self.printer.note(f"ssh pre-flight check of {len(hosts)} host(s)")
        for host, client in self.connector.preflight(hosts).items():
            self._clients[host] = [[client, 0]]
        if self.config.sync_dst_dir:
            sync_all(self.connector, hosts, self.config.sync_src_dir, self.config.sync_dst_dir,
                     {h: c[0][0] for h, c in self._clients.items()}, self.printer, self.config)

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
            channel = client.get_transport().open_session(timeout=self.config.connect_timeout)  # type: ignore[union-attr]
            channel.exec_command(remote_command(spec.argv, spec.cwd, bool(self.config.sync_dst_dir), self.config.stop_grace))
            channel.sendall(env_payload(spec.full_env()))
        except Exception as exc:
            raise SpawnError(f"cannot start {spec.name} over ssh: {type(exc).__name__}: {exc}") from exc
        handle = SshHandle(spec, channel)
        handle._threads = [
            pump(lambda: channel.recv(65536), handle, "stdout", self.printer, handle.on_marker),
            pump(lambda: channel.recv_stderr(65536), handle, "stderr", self.printer, handle.on_marker),
        ]
        return handle

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
        self.spawner.close()
        for pool in self._clients.values():
            for client, _ in pool:
                client.close()
        self._clients.clear()
