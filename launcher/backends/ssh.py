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
from ..scriptcheck import check_scripts_here, check_scripts_remote
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
        """Control lines: ``PID n`` from the guard, the runtime's (``ProcessHandle.on_marker``)."""
        verb, _, arg = text.strip().partition(" ")
        if verb == "PID" and arg.isdigit():
            self.pid = int(arg)
        else:
            super().on_marker(text)

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
            return None
        return ExitStatus(code=255, detail=f"ssh connection to {self.spec.host.label} lost")

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

    def suspend(self) -> None:
        self._send(b"STOP\n")

    def resume(self) -> None:
        self._send(b"CONT\n")

    def request_end(self) -> None:
        self._send(b"END\n")

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
        check_scripts_here([s for s in plan.processes if s.on_launcher], self.config.cwd)
        hosts = plan.remote_hosts
        if self.config.verbose:
            self.printer.note(f"ssh pre-flight check of {len(hosts)} host(s)")
        for host, client in self.connector.preflight(hosts).items():
            self._clients[host] = [[client, 0]]
        clients = {h: c[0][0] for h, c in self._clients.items()}
        if self.config.sync_dst_dir:
            sync_all(self.connector, hosts, self.config.sync_src_dir, self.config.sync_dst_dir, clients,
                     self.printer, self.config)
        check_scripts_remote([s for s in plan.processes if not s.on_launcher], clients, self.config.connect_timeout)

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
            pump(lambda: channel.recv(1 << 20), handle, "stdout", self.printer),
            pump(lambda: channel.recv_stderr(1 << 20), handle, "stderr", self.printer),
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
        self.connector.close()
