"""The mpi backend: one ``mpirun`` (Open MPI) starts every role of the job.

Ranks are laid out host by host in plan order, and ``--host h1:k1,h2:k2`` gives mpirun the same
layout (mpirun fills a host's slots before the next). Each rank runs ``launcher.mpi_rank``, which
finds its process of the plan by rank. The plan travels in the ``PSLAUNCH_MPI_PLAN`` variable and
``--env`` values as ``PSLAUNCH_ENV_<i>`` variables, all exported with ``-x NAME`` — names on the
command line, never values.

mpirun runs with ``--tag-output``; ``TagDemux`` splits its output back into each rank's stdout and
stderr (untagged lines are mpirun's own, shown as ``[mpirun]``), and reads the pid / exit status
markers ``mpi_rank`` writes. ``mpi_rank`` exits 0 once its marker is out, so mpirun never aborts the
job by itself; pslaunch decides. Signals reach the ranks only through mpirun, and each is sent once
for the whole job: stopping means one SIGTERM to mpirun (SIGKILL of its group after the grace);
Ctrl-Z is SIGUSR2 / SIGCONT and the end request SIGUSR1, which mpirun passes to every rank's
``mpi_rank`` and that to its process group. ``mpi_rank`` also dies with its parent.

Link liveness (``launcher.linkwatch``): mpirun's daemons notice no network partition, so pslaunch
sends mpirun a SIGCONT every few seconds, which it passes to every rank; ``mpi_rank`` on a remote
host answers each with a ``PONG`` marker and stops its process group once none came for
``--link-timeout`` seconds; a host none of whose ranks was heard from for that long is lost.

mpirun drops the output still on its way once it is told to stop, and with it the status markers
of ranks that were ending by themselves. So when a rank failed (the job is ending because of it),
the SIGTERM waits until every rank has reported, at most ``SETTLE`` seconds (and never more than
half of ``--stop-grace``): the bystanders' own exit codes get through, and a rank that does not end
by itself costs the job that bounded moment only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time

from ..checkpointdir import check_checkpoint_dir
from ..envcontract import EXIT_PEER_FAILED
from ..errors import ConfigError, SpawnError
from ..hostfile import Host
from ..linkwatch import LinkWatch, PongFilter
from ..network import check_plan_reachable
from ..mpi_rank import ENV_PREFIX, PLAN_VARIABLE
from ..output import LineSplitter
from ..plan import Plan, ProcessSpec
from ..scriptcheck import check_scripts_here, check_scripts_remote
from .base import Backend, ExitStatus, ProcessHandle, route_block
from .local import READ_SIZE, LocalHandle, LocalSpawner, _launcher_root

__all__ = ["MpiBackend", "MpiRankHandle", "TagDemux", "mpirun_argv"]

_TAG = re.compile(rb"\[(\d+),(\d+)\]<(stdout|stderr)>:")
_FORWARDING = re.compile(r"^mpirun: Forwarding signal \d+ to job$")
_PINGED = f"mpirun: Forwarding signal {int(signal.SIGCONT)} to job"  # the link watch's, every few seconds
_MAX_HELD = 48
#: Seconds at most that stopping the job waits, after a rank failed, for every rank's status marker.
SETTLE = 2.0


class MpiRankHandle(ProcessHandle):
    """One rank of the mpirun job. Its exit status comes from ``mpi_rank``'s marker line.

    Signals reach ranks only through mpirun, which passes them to every rank's ``mpi_rank``, so
    each handle's request goes to the backend, which sends each at most once.
    """

    def __init__(self, spec: ProcessSpec, backend: "MpiBackend") -> None:
        super().__init__(spec)
        self._backend = backend
        self._marked: ExitStatus | None = None

    def on_marker(self, text: str) -> None:
        """``PID n``, ``EXIT n`` or ``SIGNAL n`` from ``launcher.mpi_rank``; the runtime's markers."""
        verb, _, arg = text.strip().partition(" ")
        if verb not in ("PID", "EXIT", "SIGNAL"):
            super().on_marker(text)
            return
        if not arg.lstrip("-").isdigit():
            return
        if verb == "PID":
            self.pid = int(arg)
            return
        self.ended = time.monotonic()  # the marker's arrival orders the ranks' ends
        self._marked = ExitStatus(code=int(arg)) if verb == "EXIT" else ExitStatus(signal=int(arg))
        self._backend.rank_reported()

    @property
    def reported(self) -> bool:
        """Whether this rank's exit status marker arrived."""
        return self._marked is not None

    def failed(self) -> bool:
        """Whether this rank failed: it reported its own error, or a status other than 0 and 75."""
        marked = self._marked
        return self.failed_at is not None or (marked is not None and not marked.ok and marked.code != EXIT_PEER_FAILED)

    def _poll(self) -> ExitStatus | None:
        if self._marked is not None:
            return self._marked
        watch = self._backend.watch
        if self._backend.pinging and watch.lost(self.spec.host):
            self.unreachable = True
            self.ended = watch.last_heard(self.spec.host)
            return ExitStatus(code=255, detail=f"no answer for {watch.timeout:g} s", lost=True)
        mpirun = self._backend.mpirun
        if mpirun is not None and mpirun.popen.poll() is not None and self._backend.output_done.is_set():
            rc = mpirun.popen.returncode
            return ExitStatus(code=255 if rc == 0 else ExitStatus.from_returncode(rc).exit_code,
                              detail=f"no exit status from this rank; mpirun ended with {rc}")
        return None

    def in_doubt(self) -> bool:
        # once the job is being stopped mpirun passes no pings: silence then says nothing
        backend = self._backend
        return self.status is None and backend.pinging and not backend.stopping and backend.watch.in_doubt(self.spec.host)

    def terminate(self) -> None:
        self._backend.stop_job()

    def kill(self) -> None:
        self._backend.signal_mpirun(signal.SIGKILL)

    def suspend(self) -> None:
        self._backend.suspend_job(True)

    def resume(self) -> None:
        self._backend.suspend_job(False)

    def request_end(self) -> None:
        self._backend.end_job()


class TagDemux:
    """Splits mpirun's ``--tag-output`` stream into per-rank lines. One per mpirun stream.

    Chunks start with ``[job,rank]<stdout|stderr>:``; text up to the end of its line (or the next
    tag) belongs to that rank and stream. Untagged lines are mpirun's own.
    """

    def __init__(self, route) -> None:
        self._route = route  # route(rank | None, stream | None, bytes)
        self._buf = b""
        self._current: tuple[int | None, str | None] = (None, None)

    def _send(self, data: bytes) -> None:
        # A rank's text runs to the end of its line; what follows untagged is mpirun's own.
        nl = data.find(b"\n")
        if nl < 0 or self._current == (None, None):
            self._route(*self._current, data)
            return
        self._route(*self._current, data[: nl + 1])
        self._current = (None, None)
        if nl + 1 < len(data):
            self._route(None, None, data[nl + 1 :])

    def feed(self, data: bytes) -> None:
        """Add a chunk of mpirun's output."""
        self._buf += data
        pos = 0
        for match in _TAG.finditer(self._buf):
            if match.start() > pos:
                self._send(self._buf[pos : match.start()])
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
            self._send(rest)

    def close(self) -> None:
        """End of stream: route what is held back."""
        if self._buf:
            self._send(self._buf)
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
        argv += ["--mca", "plm_rsh_agent", "ssh", "--mca", "plm_rsh_args", " ".join(ssh_args)]
    for name in exported:
        argv += ["-x", name]
    argv += [python, "-m", "launcher.mpi_rank"]
    return argv


class MpiBackend(Backend):
    """Starts the whole plan with one mpirun (``--launcher mpi``). Not thread-safe."""

    name = "mpi"

    def __init__(self, config, printer) -> None:
        if config.restart_scope == "worker":
            raise ConfigError("--restart-scope worker cannot be used with --launcher mpi: one mpirun runs every rank, "
                              "so a rank cannot be started again alone; use --restart-scope job")
        super().__init__(config, printer)
        self.spawner = LocalSpawner(config.stop_grace)
        self.mpirun = None
        self.output_done = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._suspended = False
        self._ending = False
        self._ranks: list[MpiRankHandle] = []
        self._reported = threading.Condition()
        self.watch = LinkWatch(config.link_timeout)
        self.pinging = False  # whether the link watch pings the ranks yet (once every rank started)
        self._ssh_config: str | None = None  # the OpenSSH config mpirun's ssh reads (see prepare)

    def prepare(self, plan: Plan) -> None:
        """Check mpirun is there; with a hostfile, run the ssh pre-flight check (one clear line per
        failing host instead of mpirun's own errors) and ``--sync-dst-dir``."""
        if shutil.which("mpirun") is None:
            raise SpawnError("--launcher mpi: no `mpirun` on PATH (install Open MPI, e.g. apt install openmpi-bin)")
        local = [spec for spec in plan.processes if spec.host.name == "localhost"]
        check_scripts_here(local, self.config.cwd)
        remote = [h for h in plan.remote_hosts if h.name != "localhost"]
        if not remote:
            check_checkpoint_dir(plan, self.config.checkpoint_dir, {}, self.config.connect_timeout)
            return
        from ..rsync import sync_all
        from ..sshconn import SshConnector

        connector = SshConnector(self.config)
        clients: dict = {}
        try:
            clients = connector.preflight(remote)
            if self.config.sync_dst_dir:
                sync_all(connector, remote, self.config.sync_src_dir, self.config.sync_dst_dir, clients,
                         self.printer, self.config)
            check_scripts_remote([spec for spec in plan.processes if spec.host.name != "localhost"], clients,
                                 self.config.connect_timeout)
            check_checkpoint_dir(plan, self.config.checkpoint_dir, clients, self.config.connect_timeout)
            check_plan_reachable(plan, clients, self.config, self.printer)
            self._ssh_config = connector.write_openssh_config(remote)
        finally:
            for client in clients.values():
                client.close()
            connector.close()

    def stop_job(self) -> None:
        """SIGTERM to mpirun, once: it passes it to every rank (a second one while it stops its job
        can crash it, Open MPI 4.1). Ranks never make mpirun abort by itself (``mpi_rank`` exits 0).

        Non-blocking. After a rank failed, the SIGTERM is sent from a thread once every rank has
        reported its status, or after ``SETTLE`` seconds (see the module docstring)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        settle = min(SETTLE, self.config.stop_grace / 2)
        if self._suspended or settle <= 0 or not any(h.failed() for h in self._ranks):
            self._stop_now()
            return
        threading.Thread(target=self._stop_when_reported, args=(time.monotonic() + settle,),
                         name="pslaunch-mpirun-settle", daemon=True).start()

    @property
    def stopping(self) -> bool:
        """Whether the job is being stopped."""
        return self._stopping

    def rank_reported(self) -> None:
        """A rank's exit status arrived (called by the reader threads)."""
        with self._reported:
            self._reported.notify_all()

    def _stop_when_reported(self, deadline: float) -> None:
        with self._reported:
            while not all(h.reported for h in self._ranks):
                left = deadline - time.monotonic()
                if left <= 0 or self.output_done.is_set():
                    break
                self._reported.wait(min(left, 0.1))
        self._stop_now()

    def _stop_now(self) -> None:
        self.signal_mpirun(signal.SIGTERM)
        if self._suspended:
            self.suspend_job(False)  # ranks stopped with Ctrl-Z must run to end

    def suspend_job(self, stop: bool) -> None:
        """Stop (``stop``) or continue every rank: mpirun passes SIGUSR2 / SIGCONT to each
        ``mpi_rank``, which stops / continues its process group. Each change is sent once."""
        with self._lock:
            if self._suspended == stop:
                return
            self._suspended = stop
        self.signal_mpirun(signal.SIGUSR2 if stop else signal.SIGCONT)

    def end_job(self) -> None:
        """SIGUSR1 to every rank through mpirun, once every rank still running is ready for it (a
        rank that is not would die of it): the bundled nodes end normally."""
        with self._lock:
            if self._ending or not all(h.ready for h in self._ranks if h.poll() is None):
                return
            self._ending = True
        self.signal_mpirun(signal.SIGUSR1)

    def _ping(self, _: bytes) -> None:
        """The link watch's ping: a SIGCONT through mpirun to every rank, once every rank started
        (mpirun cannot pass a signal on while it still wires up its daemons: it aborts), and not
        while the job is stopped (Ctrl-Z), which a SIGCONT would end; the lock orders it with a
        stop request."""
        if not all(h.pid for h in self._ranks):
            return
        if not self.pinging:  # the hosts' clocks start with the first ping
            for host in {h.spec.host for h in self._ranks}:
                self.watch.heard(host)
            self.pinging = True
        with self._lock:
            if not self._suspended and self.mpirun is not None and self.mpirun.popen.poll() is None:
                try:
                    self.mpirun.popen.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass

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
        if self.mpirun is not None:  # a restart of the job: a new mpirun, and its requests not sent yet
            self.mpirun.close()
            self.output_done = threading.Event()
            self._stopping = self._suspended = self._ending = False
        ordered, _ = _layout(plan)
        user_vars = {}
        for spec in ordered:
            for var in spec.user_env:
                user_vars.setdefault((var.name, var.value, var.scope), len(user_vars))
        entries = []
        root = _launcher_root()
        for spec in ordered:
            entries.append({
                "name": spec.name,
                "argv": list(spec.argv),
                "env": spec.env,
                "user_env": [(v.name, user_vars[(v.name, v.value, v.scope)]) for v in spec.user_env],
                "cwd": spec.cwd,
                "grace": self.config.stop_grace,
                "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                # mpirun's own host needs no link guard: its ranks die with mpirun (PDEATHSIG)
                "link": 0 if spec.host.name == "localhost" else self.config.link_timeout,
            })
        env = {PLAN_VARIABLE: json.dumps(entries), "PYTHONPATH": root}
        env.update({f"{ENV_PREFIX}{i}": value for (_, value, _), i in user_vars.items()})
        exported = [PLAN_VARIABLE, "PYTHONPATH", *(f"{ENV_PREFIX}{i}" for i in user_vars.values())]
        ssh_args = ["-F", self._ssh_config] if self._ssh_config else None
        argv = mpirun_argv(plan, self.config.python, exported, ssh_args, bool(self.config.hosts), os.geteuid() == 0)
        handles = [MpiRankHandle(spec, self) for spec in ordered]
        self._ranks = handles
        mpirun_spec = ProcessSpec("mpirun", 0, Host("localhost"), tuple(argv), {}, on_launcher=True)
        self.mpirun = self.spawner.spawn(mpirun_spec, self.printer, argv=argv, env=env, handle_cls=MpirunHandle, readers=False)
        self.mpirun.attach(self, handles)
        for host in {spec.host for spec in ordered if spec.host.name != "localhost"}:
            self.watch.add(host, counting=False)  # counted from the first ping: mpirun starts its daemons
        self.watch.add("mpirun", self._ping)
        by_spec = {id(h.spec): h for h in handles}
        return [by_spec[id(spec)] for spec in plan.processes]

    def close(self) -> None:
        self.watch.close()
        if self.mpirun is not None:
            self.mpirun.close()
        self.spawner.close()
        if self._ssh_config:
            shutil.rmtree(os.path.dirname(self._ssh_config), ignore_errors=True)
            self._ssh_config = None


class MpirunHandle(LocalHandle):
    """mpirun itself: its output is read by ``TagDemux`` threads instead of plain readers. It puts
    each daemon's ssh and each local rank in a process group of its own, in its session: killing it
    kills that whole session."""

    def kill(self) -> None:
        super().kill()
        for pid in _session_members(self.popen.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def attach(self, backend: MpiBackend, ranks: list[MpiRankHandle]) -> None:
        """Start the threads that split mpirun's output into the ranks' lines."""
        done: list[str] = []
        for stream, pipe in (("stdout", self.popen.stdout), ("stderr", self.popen.stderr)):
            thread = threading.Thread(target=_read_tagged, args=(pipe, stream, ranks, backend, done),
                                      name=f"pslaunch-mpirun-{stream}", daemon=True)
            thread.start()
            self._threads.append(thread)


def _session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (from /proc; empty elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            found.append(int(entry))
    return found


def _read_tagged(pipe, stream: str, ranks: list[MpiRankHandle], backend: MpiBackend, done: list) -> None:
    printer = backend.printer
    verbose = backend.config.verbose
    splitters: dict[tuple[int | None, str], LineSplitter] = {}

    def splitter_for(rank: int | None, sub: str) -> LineSplitter:
        key = (rank, sub)
        if key not in splitters:
            if rank is None or rank >= len(ranks):
                def emit(block: str, sub: str = sub) -> None:
                    # mpirun reports each signal pslaunch sent through it (shown with -v, but pings)
                    block = "\n".join(t for t in block.split("\n") if t != _PINGED and (verbose or not _FORWARDING.match(t)))
                    if not block:
                        return
                    printer.lines("mpirun", "mpirun", block, sub)
            else:
                def emit(block: str, handle: MpiRankHandle = ranks[rank], sub: str = sub) -> None:
                    route_block(handle, sub, printer, block)
            splitters[key] = LineSplitter(emit)
        return splitters[key]

    pongs: dict[tuple[int, str], PongFilter] = {}

    def feed(rank: int | None, sub: str, data: bytes) -> None:
        if rank is not None and rank < len(ranks):  # word from the rank's host; its answers to pings go
            backend.watch.heard(ranks[rank].spec.host)
            data = pongs.setdefault((rank, sub), PongFilter()).feed(data)
        if data:
            splitter_for(rank, sub).feed(data)

    demux = TagDemux(lambda rank, sub, data: feed(rank, sub or stream, data))
    try:
        while True:
            try:
                data = os.read(pipe.fileno(), READ_SIZE)
            except (OSError, ValueError):
                break
            if not data:
                break
            demux.feed(data)
    finally:
        demux.close()
        for (rank, sub), held in pongs.items():
            rest = held.feed(b"")
            if rest:
                splitter_for(rank, sub).feed(rest)
        for s in splitters.values():
            s.close()
        done.append(stream)
        if len(done) == 2:
            backend.output_done.set()
