"""The mpi backend: one ``mpirun`` (Open MPI) starts every role of the job.

Ranks are laid out host by host in plan order, and ``--host h1:k1,h2:k2`` gives mpirun the same
layout (mpirun fills a host's slots before the next). Each rank runs ``launcher.on_node.rank_shim``, which
finds its process of the plan by rank. The plan travels in the ``PSLAUNCH_MPI_PLAN`` variable and
``--env`` values as ``PSLAUNCH_ENV_<i>`` variables, all exported with ``-x NAME`` — names on the
command line, never values.

mpirun runs with ``--tag-output``; ``TagDemux`` splits its output back into each rank's stdout and
stderr (untagged lines are mpirun's own, shown as ``[mpirun]``), and reads the pid / exit status
markers ``rank_shim`` writes (``ShimHandle``). ``rank_shim`` exits 0 once its marker is out, so mpirun
never aborts the job by itself; pslaunch decides. Signals reach the ranks only through mpirun, and
each is sent once for the whole job (``ShimJob``), and only signals mpirun passes to every rank's
``rank_shim`` and that to its process group: stopping is SIGALRM, which ``rank_shim`` turns into
SIGTERM (mpirun's own SIGTERM aborts the job, killing the ranks a second later with their exit
statuses unsaid; SIGKILL of mpirun's session after the grace), Ctrl-Z is SIGUSR2 / SIGCONT and the
end request SIGUSR1. ``rank_shim`` also dies with its parent.

Link liveness (``launcher.backends.ssh.linkwatch``): mpirun's daemons notice no network partition, so pslaunch
sends mpirun a SIGCONT every few seconds, which it passes to every rank; ``rank_shim`` on a remote
host answers each with a ``PONG`` marker and stops its process group once none came for
``--link-timeout`` seconds; a host none of whose ranks was heard from for that long is lost.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading

from ..errors import ConfigError, SpawnError
from ..observe.output import LineSplitter
from ..on_node.process_groups import SHIM_SIGNALS
from ..on_node.procfs import session_members
from ..on_node.rank_shim import payload
from ..planning.hostfile import Host
from ..planning.plan import Plan, ProcessSpec, make_plan
from .base import Backend, ExitStatus, ProcessHandle, route_block
from .checks.checkpoint_dir import check_checkpoint_dir
from .checks.script import check_scripts_here, check_scripts_remote
from .local import READ_SIZE, LocalHandle, LocalSpawner, _launcher_root
from .shim import ShimHandle, ShimJob
from .ssh.connection import resolve_over_ssh
from .ssh.linkwatch import LinkWatch, PongFilter
from .ssh.reach import check_plan_reachable

__all__ = ["MpiBackend", "TagDemux", "mpirun_argv"]

_TAG = re.compile(rb"\[(\d+),(\d+)\]<(stdout|stderr)>:")
_FORWARDING = re.compile(r"^mpirun: Forwarding signal \d+ to job$")
_PINGED = f"mpirun: Forwarding signal {int(signal.SIGCONT)} to job"  # the link watch's, every few seconds
_MAX_HELD = 48


class MpiRankHandle(ShimHandle):
    """One rank of the mpirun job (``ShimHandle``), which the link watch may also find lost: its host
    was silent for ``--link-timeout`` seconds."""

    def __init__(self, spec: ProcessSpec, backend: "MpiBackend") -> None:
        super().__init__(spec, backend.shim)
        self._backend = backend

    def _poll(self) -> ExitStatus | None:
        if self._marked is not None:
            return self._marked
        watch = self._backend.watch
        # before mpirun's end: mpirun aborts once it loses a host's daemon, yet the host is the news
        if self._backend.pinging and watch.lost(self.spec.host):
            return self._lost(f"no answer for {watch.timeout:g} s", watch.last_heard(self.spec.host))
        return super()._poll()

    def in_doubt(self) -> bool:
        # once the job is being stopped mpirun passes no pings: silence then says nothing
        backend = self._backend
        return (self.status is None and backend.pinging and not backend.shim.stopping
                and backend.watch.in_doubt(self.spec.host))


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
    argv += [python, "-m", "launcher.on_node.rank_shim"]
    return argv


class MpiBackend(Backend):
    """Starts the whole plan with one mpirun (``--launcher mpi``). Not thread-safe."""

    name = "mpi"
    refuses = {"server_replicas": "one mpirun runs every rank and ends them all when one is lost, so no replica "
                                  "could take a lost server's place",
               "cpu_bind": "mpirun binds the ranks itself: set OMPI_MCA_hwloc_base_binding_policy=core (or numa) in "
                           "pslaunch's environment"}

    @classmethod
    def resolve(cls, config):
        return resolve_over_ssh(config)

    @classmethod
    def make_plan(cls, config):
        return make_plan(config, all_through_launcher=True)  # one mpirun starts every rank, this machine's too

    @classmethod
    def configure(cls, config, environ):
        if config.restart_scope == "worker":
            raise ConfigError("--restart-scope worker cannot be used with --launcher mpi: one mpirun runs every rank, "
                              "so a rank cannot be started again alone; use --restart-scope job")
        return config

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.spawner = LocalSpawner(config.stop_grace)
        self.shim = ShimJob("mpirun", self._deliver)
        self.watch = LinkWatch(config.link_timeout)
        self.pinging = False  # whether the link watch pings the ranks yet (once every host's ranks spoke)
        # hosts with a rank that wrote anything (a marker or output): mpirun's daemon there is up and
        # wired, so a signal through mpirun no longer makes it abort
        self.spoke: set[Host] = set()
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
            check_checkpoint_dir(plan, self.config.checkpoint_dir, {}, self.config.ssh.connect_timeout)
            return
        from .ssh.connection import SshConnector
        from .ssh.rsync import sync_all

        connector = SshConnector(self.config)
        clients: dict = {}
        try:
            clients = connector.preflight(remote)
            if self.config.sync_dst_dir:
                sync_all(connector, remote, self.config.sync_src_dir, self.config.sync_dst_dir, clients,
                         self.printer, self.config)
            check_scripts_remote([spec for spec in plan.processes if spec.host.name != "localhost"], clients,
                                 self.config.ssh.connect_timeout)
            check_checkpoint_dir(plan, self.config.checkpoint_dir, clients, self.config.ssh.connect_timeout)
            check_plan_reachable(plan, clients, self.config, self.printer)
            self._ssh_config = connector.write_openssh_config(remote)
        finally:
            for client in clients.values():
                client.close()
            connector.close()

    def _deliver(self, verb: str) -> None:
        """One signal to mpirun, which passes it to every rank's ``rank_shim`` (SIGKILL goes to
        mpirun's whole process group). Ranks never make mpirun abort by itself (``rank_shim`` exits
        0), and a second SIGTERM while it stops its job could crash it (Open MPI 4.1): ``ShimJob``
        sends each request once."""
        mpirun = self.shim.launcher
        assert mpirun is not None
        if verb == "KILL":
            mpirun.kill()
            return
        # Only signals mpirun passes on: rank_shim turns SIGUSR2 into SIGSTOP of its process group and
        # SIGALRM into SIGTERM. On a SIGTERM of its own mpirun aborts the job: it SIGKILLs every
        # rank_shim 1 s later and drops their output, exit statuses included.
        sig = SHIM_SIGNALS[verb]
        try:
            mpirun.popen.send_signal(sig)
        except ProcessLookupError:
            pass

    def _ping(self, _: bytes) -> None:
        """The link watch's ping: a SIGCONT through mpirun to every rank, once a rank on every host
        spoke (mpirun cannot pass a signal on while it still wires up its daemons: it aborts; a rank's
        pid marker may come later than its output, and the guards count from their start), and not
        while the job is stopped (Ctrl-Z), which a SIGCONT would end (``ShimJob.unless_suspended``
        orders it with a stop request)."""
        handles = self.shim.handles
        if not handles or not {h.spec.host for h in handles} <= self.spoke:
            return
        if not self.pinging:  # the hosts' clocks start with the first ping
            for host in {h.spec.host for h in self.shim.handles}:
                self.watch.heard(host)
            self.pinging = True
        self.shim.unless_suspended(lambda launcher: launcher.popen.send_signal(signal.SIGCONT))

    def launch(self, plan: Plan) -> list[ProcessHandle]:
        restarted = self.shim.launcher is not None
        if restarted:  # a restart of the job: a new mpirun, and none of its requests sent yet
            self.shim.launcher.close()
            self.shim = ShimJob("mpirun", self._deliver)
            self.pinging = False
            self.spoke = set()
        ordered, _ = _layout(plan)
        # mpirun's own host needs no link guard: its ranks die with mpirun (PDEATHSIG)
        env = payload(ordered, self.config.stop_grace, os.environ.get("PYTHONPATH", ""),
                      lambda spec: 0 if spec.host.name == "localhost" else self.config.link_timeout)
        exported = [*env, "PYTHONPATH"]
        env["PYTHONPATH"] = _launcher_root()
        ssh_args = ["-F", self._ssh_config] if self._ssh_config else None
        argv = mpirun_argv(plan, self.config.python, exported, ssh_args, bool(self.config.hosts), os.geteuid() == 0)
        handles = [MpiRankHandle(spec, self) for spec in ordered]
        self.shim.handles = handles
        mpirun_spec = ProcessSpec("mpirun", 0, Host("localhost"), tuple(argv), {}, on_launcher=True)
        mpirun = self.spawner.spawn(mpirun_spec, self.printer, argv=argv, env=env, handle_cls=MpirunHandle, readers=False)
        self.shim.launcher = mpirun
        mpirun.attach(self, handles)
        for host in {spec.host for spec in ordered if spec.host.name != "localhost"}:
            self.watch.add(host, counting=False)  # counted from the first ping: mpirun starts its daemons
        if not restarted:
            self.watch.add("mpirun", self._ping)
        by_spec = {id(h.spec): h for h in handles}
        return [by_spec[id(spec)] for spec in plan.processes]

    def close(self) -> None:
        self.watch.close()
        if self.shim.launcher is not None:
            self.shim.launcher.close()
        self.spawner.close()
        if self._ssh_config:
            shutil.rmtree(os.path.dirname(self._ssh_config), ignore_errors=True)
            self._ssh_config = None


class MpirunHandle(LocalHandle):
    """mpirun itself: its output is read by ``TagDemux`` threads instead of plain readers. It puts
    each daemon's ssh and each local rank in a process group of its own, in its session: killing it
    kills that whole session."""

    def _tell(self, verb: str) -> None:
        super()._tell(verb)
        if verb == "KILL" and self.group.ours():  # its session's id, not a stranger's that took the number
            for pid in session_members(self.popen.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def attach(self, backend: MpiBackend, ranks: list[ShimHandle]) -> None:
        """Start the threads that split mpirun's output into the ranks' lines."""
        done: list[str] = []
        for stream, pipe in (("stdout", self.popen.stdout), ("stderr", self.popen.stderr)):
            thread = threading.Thread(target=_read_tagged, args=(pipe, stream, ranks, backend, done),
                                      name=f"pslaunch-mpirun-{stream}", daemon=True)
            thread.start()
            self._threads.append(thread)


def _read_tagged(pipe, stream: str, ranks: list[ShimHandle], backend: MpiBackend, done: list) -> None:
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
                    said = [t.strip() for t in block.split("\n") if t.strip()]
                    if said:  # why mpirun ended, if it did before the ranks reported
                        backend.shim.last_line = said[-1]
                    printer.lines("mpirun", "mpirun", block, sub)
            else:
                def emit(block: str, handle: ShimHandle = ranks[rank], sub: str = sub) -> None:
                    route_block(handle, sub, printer, block)
            splitters[key] = LineSplitter(emit)
        return splitters[key]

    pongs: dict[tuple[int, str], PongFilter] = {}

    def feed(rank: int | None, sub: str, data: bytes) -> None:
        if rank is not None and rank < len(ranks):  # word from the rank's host; its answers to pings go
            backend.spoke.add(ranks[rank].spec.host)
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
            backend.shim.output_done.set()
