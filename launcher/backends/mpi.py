"""The mpi backend: one ``mpirun`` (Open MPI) starts every role of the job.

Ranks are laid out host by host in plan order, and ``--host h1:k1,h2:k2`` gives mpirun the same
layout (mpirun fills a host's slots before the next). Each rank runs ``launcher.mpi_rank``, which
finds its process of the plan by rank. The plan travels in the ``PSLAUNCH_MPI_PLAN`` variable and
``--env`` values as ``PSLAUNCH_ENV_<i>`` variables, all exported with ``-x NAME`` — names on the
command line, never values.

mpirun runs with ``--tag-output``; ``TagDemux`` splits its output back into each rank's stdout and
stderr, and reads the pid / exit status markers ``mpi_rank`` writes. Stopping a rank means stopping
mpirun (SIGTERM, which it forwards; SIGKILL of its group); ``mpi_rank`` also dies with its parent.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading

from ..errors import SpawnError
from ..hostfile import Host
from ..mpi_rank import payload
from ..output import LineSplitter
from ..plan import Plan, ProcessSpec
from .base import MARKER, Backend, ExitStatus, ProcessHandle
from .local import LocalHandle, LocalSpawner, _launcher_root

__all__ = ["MpiBackend", "MpiRankHandle", "TagDemux", "mpirun_argv"]

_TAG = re.compile(rb"\[(\d+),(\d+)\]<(stdout|stderr)>:")
_MAX_HELD = 48


class MpiRankHandle(ProcessHandle):
    """One rank of the mpirun job. Its exit status comes from ``mpi_rank``'s marker line."""

    def __init__(self, spec: ProcessSpec, backend: "MpiBackend") -> None:
        super().__init__(spec)
        self._backend = backend
        self._marked: ExitStatus | None = None

    def on_marker(self, text: str) -> None:
        """``PID n``, ``EXIT n`` or ``SIGNAL n`` from ``launcher.mpi_rank``."""
        verb, _, arg = text.strip().partition(" ")
        if not arg.lstrip("-").isdigit():
            return
        if verb == "PID":
            self.pid = int(arg)
        elif verb == "EXIT":
            self._marked = ExitStatus(code=int(arg))
        elif verb == "SIGNAL":
            self._marked = ExitStatus(signal=int(arg))

    def _poll(self) -> ExitStatus | None:
        if self._marked is not None:
            return self._marked
        mpirun = self._backend.mpirun
        if mpirun is not None and mpirun.popen.poll() is not None and self._backend.output_done.is_set():
            rc = mpirun.popen.returncode
            return ExitStatus(code=255 if rc == 0 else ExitStatus.from_returncode(rc).exit_code,
                              detail=f"no exit status from this rank; mpirun ended with {rc}")
        return None

    def terminate(self) -> None:
        self._backend.signal_mpirun(signal.SIGTERM)

    def kill(self) -> None:
        self._backend.signal_mpirun(signal.SIGKILL)


class TagDemux:
    """Splits mpirun's ``--tag-output`` stream into per-rank lines. One per mpirun stream.

    Chunks start with ``[job,rank]<stdout|stderr>:``; text up to the next tag belongs to that rank
    and stream (partial lines included). Untagged text is mpirun's own.
    """

    def __init__(self, route) -> None:
        self._route = route  # route(rank | None, stream | None, bytes)
        self._buf = b""
        self._current: tuple[int | None, str | None] = (None, None)

    def feed(self, data: bytes) -> None:
        """Add a chunk of mpirun's output."""
        self._buf += data
        pos = 0
        for match in _TAG.finditer(self._buf):
            if match.start() > pos:
                self._route(*self._current, self._buf[pos : match.start()])
            self._current = (int(match.group(2)), match.group(3).decode())
            pos = match.end()
        rest = self._buf[pos:]
        # A tag may be cut in two by the read: hold back a short tail that could start one.
        cut = rest.rfind(b"[")
        if cut >= 0 and len(rest) - cut < _MAX_HELD and b"\n" not in rest[cut:]:
            self._buf = rest[cut:]
            rest = rest[:cut]
        else:
            self._buf = b""
        if rest:
            self._route(*self._current, rest)

    def close(self) -> None:
        """End of stream: route what is held back."""
        if self._buf:
            self._route(*self._current, self._buf)
            self._buf = b""


def _layout(plan: Plan) -> tuple[list[ProcessSpec], list[tuple[Host, int]]]:
    """Processes in MPI rank order (grouped by host) and the ``(host, count)`` list for ``--host``."""
    groups: dict[Host, list[ProcessSpec]] = {}
    for spec in plan.processes:
        groups.setdefault(spec.host, []).append(spec)
    ordered = [spec for specs in groups.values() for spec in specs]
    return ordered, [(host, len(specs)) for host, specs in groups.items()]


def mpirun_argv(plan: Plan, python: str, exported: list[str], ssh_args: list[str] | None,
                has_hostfile: bool, as_root: bool) -> list[str]:
    """The mpirun command line (names of exported variables only, never values)."""
    ordered, hosts = _layout(plan)
    argv = ["mpirun"]
    if as_root:
        argv.append("--allow-run-as-root")
    argv += ["--oversubscribe", "--tag-output", "-np", str(len(ordered))]
    if has_hostfile:
        argv += ["--host", ",".join(f"{'localhost' if h.name == 'localhost' else h.name}:{n}" for h, n in hosts)]
    if ssh_args:
        argv += ["--mca", "plm_rsh_args", " ".join(ssh_args)]
    for name in exported:
        argv += ["-x", name]
    argv += [python, "-m", "launcher.mpi_rank"]
    return argv


class MpiBackend(Backend):
    """Starts the whole plan with one mpirun (``--launcher mpi``). Not thread-safe."""

    name = "mpi"

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.spawner = LocalSpawner(config.stop_grace)
        self.mpirun = None
        self.output_done = threading.Event()
        self._lock = threading.Lock()

    def prepare(self, plan: Plan) -> None:
        """Check mpirun is there; with a hostfile, run the ssh pre-flight check (one clear line per
        failing host instead of mpirun's own errors) and ``--sync-dst-dir``."""
        if shutil.which("mpirun") is None:
            raise SpawnError("--launcher mpi: no `mpirun` on PATH (install Open MPI, e.g. apt install openmpi-bin)")
        remote = [h for h in plan.remote_hosts if h.name != "localhost"]
        if not remote:
            return
        from ..rsync import sync_all
        from ..sshconn import SshConnector

        connector = SshConnector(self.config)
        clients = connector.preflight(remote)
        try:
            if self.config.sync_dst_dir:
                sync_all(connector, remote, self.config.sync_src_dir, self.config.sync_dst_dir, clients,
                         self.printer, self.config)
        finally:
            for client in clients.values():
                client.close()

    def signal_mpirun(self, sig: int) -> None:
        """Send ``sig`` to mpirun (SIGKILL goes to its whole process group)."""
        with self._lock:
            if self.mpirun is None:
                return
            if sig == signal.SIGKILL:
                self.mpirun.kill()
            elif self.mpirun.popen.poll() is None:
                try:
                    self.mpirun.popen.send_signal(sig)
                except ProcessLookupError:
                    pass

    def launch(self, plan: Plan) -> list[ProcessHandle]:
        ordered, _ = _layout(plan)
        env = payload(ordered, self.config.stop_grace, os.environ.get("PYTHONPATH", ""))
        exported = [*env, "PYTHONPATH"]
        env["PYTHONPATH"] = _launcher_root()
        ssh_args = _ssh_args(self.config) if self.config.hosts else None
        argv = mpirun_argv(plan, self.config.python, exported, ssh_args, bool(self.config.hosts), os.geteuid() == 0)
        handles = [MpiRankHandle(spec, self) for spec in ordered]
        mpirun_spec = ProcessSpec("mpirun", 0, Host("localhost"), tuple(argv), {}, on_launcher=True)
        self.mpirun = self.spawner.spawn(mpirun_spec, self.printer, argv=argv, env=env, handle_cls=MpirunHandle, readers=False)
        self.mpirun.attach(self, handles)
        by_spec = {id(h.spec): h for h in handles}
        return [by_spec[id(spec)] for spec in plan.processes]

    def close(self) -> None:
        if self.mpirun is not None:
            self.mpirun.close()
        self.spawner.close()


def _ssh_args(config) -> list[str]:
    """Options for the ssh mpirun uses to start its daemons: the job's port, key, user and host-key policy."""
    args = ["-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
    if config.ssh_port:
        args += ["-p", str(config.ssh_port)]
    if config.identity:
        args += ["-i", config.identity]
    if config.ssh_user:
        args += ["-l", config.ssh_user]
    if config.ssh_config:
        args += ["-F", os.path.expanduser(config.ssh_config)]
    strict = {"accept-new": "accept-new", "strict": "yes", "ignore": "no"}[config.host_key_policy]
    known = "/dev/null" if config.host_key_policy == "ignore" else os.path.expanduser(config.known_hosts or "~/.ssh/known_hosts")
    return args + ["-o", f"StrictHostKeyChecking={strict}", "-o", f"UserKnownHostsFile={known}"]


class MpirunHandle(LocalHandle):
    """mpirun itself: its output is read by ``TagDemux`` threads instead of plain readers."""

    def attach(self, backend: MpiBackend, ranks: list[MpiRankHandle]) -> None:
        """Start the threads that split mpirun's output into the ranks' lines."""
        done: list[str] = []
        for stream, pipe in (("stdout", self.popen.stdout), ("stderr", self.popen.stderr)):
            thread = threading.Thread(target=_read_tagged, args=(pipe, stream, ranks, backend, done),
                                      name=f"pslaunch-mpirun-{stream}", daemon=True)
            thread.start()
            self._threads.append(thread)


def _read_tagged(pipe, stream: str, ranks: list[MpiRankHandle], backend: MpiBackend, done: list) -> None:
    printer = backend.printer
    splitters: dict[tuple[int | None, str], LineSplitter] = {}

    def splitter_for(rank: int | None, sub: str) -> LineSplitter:
        key = (rank, sub)
        if key not in splitters:
            if rank is None or rank >= len(ranks):
                def emit(text, sub=sub):
                    printer.line("mpirun", "mpirun", text, sub)
            else:
                handle = ranks[rank]

                def emit(text, handle=handle, sub=sub):
                    if MARKER in text:
                        before, _, control = text.partition(MARKER)
                        if before:
                            printer.line(handle.spec.name, handle.spec.role, before, sub)
                        handle.on_marker(control)
                    else:
                        printer.line(handle.spec.name, handle.spec.role, text, sub)
            splitters[key] = LineSplitter(emit)
        return splitters[key]

    demux = TagDemux(lambda rank, sub, data: splitter_for(rank, sub or stream).feed(data))
    try:
        while True:
            try:
                data = os.read(pipe.fileno(), 65536)
            except (OSError, ValueError):
                break
            if not data:
                break
            demux.feed(data)
    finally:
        demux.close()
        for s in splitters.values():
            s.close()
        done.append(stream)
        if len(done) == 2:
            backend.output_done.set()
