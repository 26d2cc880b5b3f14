"""Planning: which process runs where, with which argv and environment.

``make_plan`` is a pure function of a resolved ``LaunchConfig``: it starts nothing and opens
nothing, so ``--dry-run`` prints exactly what a real launch would do and tests check placement
without processes.

Placement (also in docs/launcher.md):

* **workers** are spread over the hosts in hostfile order, one at a time, skipping hosts whose
  ``slots`` are used up; more workers than the slots of a hostfile where every host has
  ``slots=`` is an error. A host without ``slots=`` takes any number.
* **servers** go round-robin over the hosts, independent of slots; with ``-s 0`` there are none
  (allreduce mode: the scheduler and the workers only).
* **the scheduler** runs on the launching host, or on ``--scheduler-host``.
* ``local`` backend: everything on this machine, ``DMLC_PS_ROOT_URI=127.0.0.1``.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, replace

import pscontract as ec

from ..config import EnvVar, LaunchConfig
from ..errors import PlacementError
from .hostfile import LOCAL_HOST, Host

__all__ = ["ProcessSpec", "Plan", "make_plan", "joiner_spec", "format_plan", "command_argv", "runtime_argv", "script_of",
           "PYTHON_WORDS", "STATS_INTERVAL"]


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the job.

    ``on_launcher`` means it runs on the launching machine as a child of pslaunch (not over ssh).
    ``env`` holds the contract variables and ``PYTHONUNBUFFERED`` (not secret); ``user_env`` the
    ``--env`` variables that apply to this role, whose values are never printed. ``cwd`` None means
    "inherit". ``script`` is the file COMMAND runs, when pslaunch can tell (checked before start).
    """

    role: str
    rank: int
    host: Host
    argv: tuple[str, ...]
    env: dict[str, str]
    user_env: tuple[EnvVar, ...] = ()
    local_rank: int = 0
    local_size: int = 1
    cwd: str | None = None
    on_launcher: bool = True
    script: str | None = None

    @property
    def name(self) -> str:
        """``worker.3@host``: how output lines, the summary and errors name this process."""
        return f"{self.role}.{self.rank}@{self.host.label}"

    def full_env(self) -> dict[str, str]:
        """Contract variables plus the ``--env`` ones (which win), as one dict. Holds secrets."""
        env = dict(self.env)
        env.update({v.name: v.value for v in self.user_env})
        return env


@dataclass(frozen=True)
class Plan:
    """The whole job: its id, where the scheduler listens, and the processes in start order."""

    job_id: str
    backend: str
    root_uri: str
    root_port: int
    processes: tuple[ProcessSpec, ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = ()  # what pslaunch chose for the job that its user should read once (threads)

    def restarted(self, count: int, processes: "tuple[ProcessSpec, ...] | None" = None) -> "Plan":
        """This plan (or the part of it in ``processes``) for its ``count``-th restart: the same
        processes, each told how many restarts came before it (``PSLAUNCH_RESTART_COUNT``)."""
        specs = self.processes if processes is None else processes
        return replace(self, processes=tuple(replace(p, env=ec.with_restart_count(p.env, count)) for p in specs))

    def by_role(self, role: str) -> list[ProcessSpec]:
        """The processes of ``role`` in rank order."""
        return [p for p in self.processes if p.role == role]

    @property
    def remote_hosts(self) -> list[Host]:
        """Distinct hosts that processes run on over ssh, in first-use order."""
        seen: dict[tuple, Host] = {}
        for p in self.processes:
            if not p.on_launcher:
                seen.setdefault((p.host.user, p.host.name, p.host.port), p.host)
        return list(seen.values())


#: Seconds between the scheduler's stats lines when pslaunch shows or serves the job's counters.
STATS_INTERVAL = 0.5

#: First words of COMMAND that mean "the job's Python" (``--python``, default the launching one).
PYTHON_WORDS = ("python", "python3")


def command_argv(command: tuple[str, ...], python: str) -> tuple[str, ...]:
    """The user's COMMAND as argv: a first word ending in ``.py`` runs under ``python``, and a first
    word ``python`` or ``python3`` becomes ``python`` (so remote hosts run the same interpreter,
    with its packages, instead of whatever their login shell finds first)."""
    if command[0].endswith(".py"):
        return (python, *command)
    if command[0] in PYTHON_WORDS:
        return (python, *command[1:])
    return tuple(command)


def script_of(command: tuple[str, ...]) -> str | None:
    """The script file COMMAND runs, when it is plain: ``train.py ...`` or ``python[3] train.py ...``
    (not ``python -m pkg``, ``python -c ...`` or another program)."""
    if command[0].endswith(".py"):
        return command[0]
    if command[0] in PYTHON_WORDS and len(command) > 1 and not command[1].startswith("-"):
        return command[1]
    return None


def runtime_argv(role: str, python: str) -> tuple[str, ...]:
    """argv of the bundled runtime for ``scheduler`` or ``server``: ``python -m psnode ROLE``."""
    return (python, "-m", "psnode", role)


def _place_workers(hosts: list[Host], count: int) -> list[Host]:
    if all(h.slots is not None for h in hosts):
        total = sum(h.slots for h in hosts)  # type: ignore[misc]
        if count > total:
            raise PlacementError(
                f"{count} workers do not fit the {total} slots of the hostfile "
                f"({', '.join(f'{h.label} slots={h.slots}' for h in hosts)}); "
                "lower -n, raise slots= or drop slots= from a host to let it take any number"
            )
    used = {i: 0 for i in range(len(hosts))}
    placed: list[Host] = []
    i = 0
    while len(placed) < count:
        host = hosts[i % len(hosts)]
        if host.slots is None or used[i % len(hosts)] < host.slots:
            used[i % len(hosts)] += 1
            placed.append(host)
        i += 1
    return placed


def _cwd(config: LaunchConfig, host: Host, on_launcher: bool, remote_cwd: str | None) -> str | None:
    if on_launcher:
        return None  # a child of pslaunch: inherits its directory
    if host is LOCAL_HOST:
        return config.cwd  # an MPI rank on this machine: pslaunch's directory
    return remote_cwd


def first_worker_host(config: LaunchConfig) -> Host:
    """The host worker 0 runs on (``LOCAL_HOST`` for the local backend or without a hostfile)."""
    if not config.hosts:  # the local backend refuses -H: no hosts means this machine
        return LOCAL_HOST
    return _place_workers(list(config.hosts), 1)[0]


def torch_master_address(config: LaunchConfig, host: Host) -> str:
    """``MASTER_ADDR`` for worker 0 on ``host``: a loopback address when every process is on this
    machine, the address the other hosts reach this machine at when worker 0 runs here, else the
    host's name as the hostfile gives it (what torchrun's ``--master-addr`` would be). Per-node agents
    place worker 0 on node 0, which every node reaches at the rendezvous host."""
    if config.agents.nnodes is not None:
        return config.launch_address
    if host is LOCAL_HOST or host.is_loopback:
        all_here = all(h.is_loopback for h in config.hosts)  # True without hosts
        if not all_here:  # other hosts dial it: this machine's address toward them
            return config.launch_address
        return "127.0.0.1" if host is LOCAL_HOST or host.name == "localhost" else host.name
    return host.name


def make_plan(config: LaunchConfig, all_through_launcher: bool = False) -> Plan:
    """Return the plan for a resolved ``config`` (see ``launcher.planning.network.resolve``). Pure.

    ``all_through_launcher``: every process, this machine's too, is started by the backend's own
    launcher (one ``mpirun``), none as a child of pslaunch (``on_launcher`` False everywhere).

    Raises ``PlacementError`` when the workers do not fit the hostfile's slots.
    """
    assert config.scheduler_port is not None, "make_plan needs a resolved config"
    local_only = not config.hosts
    hosts = [LOCAL_HOST] if local_only else list(config.hosts)

    if config.scheduler_host:
        sched_host = Host(config.scheduler_host)
        for h in config.hosts:  # reuse user/port the hostfile gives for that host
            if h.name == config.scheduler_host:
                sched_host = Host(h.name, h.user, h.port)
                break
        root_uri = config.launch_address  # its real name (ssh config's HostName), see network.resolve
    else:
        sched_host = LOCAL_HOST
        root_uri = "127.0.0.1" if local_only else config.launch_address

    placed: list[tuple[str, int, Host]] = [("scheduler", 0, sched_host)]
    placed += [("server", r, hosts[r % len(hosts)]) for r in range(config.num_servers)]
    placed += [("worker", r, h) for r, h in enumerate(_place_workers(hosts, config.start_workers))]
    # --server-replicas: replica i starts beside server i mod S; the scheduler gives it the keys of a
    # server on another host where there is one (a lost host then loses no server's keys)
    placed += [("replica", r, hosts[(r % config.num_servers) % len(hosts)])
               for r in range(config.server_replicas * config.num_servers)]

    sizes: dict[tuple[str, Host], int] = {}
    for role, _, host in placed:
        sizes[(role, host)] = sizes.get((role, host), 0) + 1
    threads, notes = thread_share(config, placed)
    notes += settings_left_note(config.settings_left)
    slots = cpu_slots(placed) if config.cpu_bind != "none" else []
    seen: dict[tuple[str, Host], int] = {}

    shared = _Shared.of(config, root_uri, placed, all_through_launcher)
    processes = []
    for role, rank, host in placed:
        local_rank = seen.get((role, host), 0)
        seen[(role, host)] = local_rank + 1
        processes.append(shared.spec(role, rank, host, local_rank, sizes[(role, host)], threads.get(host),
                                     slots[len(processes)] if slots else None))
    return Plan(config.job_id, config.backend, root_uri, config.scheduler_port, tuple(processes), notes)


@dataclass(frozen=True)
class _Shared:
    """What every process of one job's plan shares: its settings, argv, secrets, where to find the
    scheduler and torch's master; ``spec`` makes one process of it (``make_plan``, ``joiner_spec``)."""

    config: LaunchConfig
    root_uri: str
    settings: dict
    user_argv: tuple[str, ...]
    secrets: tuple[EnvVar, ...]
    all_local: bool
    local_only: bool
    remote_cwd: str | None
    master: tuple[str, int] | None
    all_through_launcher: bool

    @classmethod
    def of(cls, config: LaunchConfig, root_uri: str, placed: list[tuple[str, int, Host]],
           all_through_launcher: bool) -> "_Shared":
        # the job's key travels as a secret, like --env values: never in the printed plan or a command line
        given = any(v.name == ec.PSLAUNCH_JOB_KEY for v in config.env)
        secrets = () if given or not config.job_key else (EnvVar(ec.PSLAUNCH_JOB_KEY, config.job_key, "all"),)
        local_only = not config.hosts
        settings = {}
        if config.encrypt:
            settings[ec.PSLAUNCH_ENCRYPT] = "curve"
        if config.wants_stats:
            settings[ec.PSLAUNCH_STATS] = f"{STATS_INTERVAL:g}"
        if config.timeline:
            settings[ec.PSLAUNCH_TIMELINE] = ec.TIMELINE_TO_LAUNCHER
        if config.checkpoint_dir:
            settings[ec.PSLAUNCH_CHECKPOINT_DIR] = config.checkpoint_dir
        if config.restart_scope != "job":
            settings[ec.PSLAUNCH_RESTART_SCOPE] = config.restart_scope
        if config.server_replicas:
            settings[ec.PSLAUNCH_SERVER_REPLICAS] = str(config.server_replicas)
        if config.stall_warn != 60.0:  # the runtime's default otherwise
            settings[ec.PSLAUNCH_STALL_WARN] = f"{config.stall_warn:g}"
        if config.elastic:
            settings[ec.PSLAUNCH_MIN_WORKERS] = str(config.min_workers)
            settings[ec.PSLAUNCH_ELASTIC_TIMEOUT] = f"{config.elastic_timeout:g}"
            if config.start_workers < config.num_workers:  # the rest join when slots appear
                settings[ec.PSLAUNCH_START_WORKERS] = str(config.start_workers)
        if config.stall_timeout:
            settings[ec.PSLAUNCH_STALL_TIMEOUT] = f"{config.stall_timeout:g}"
        # torch.distributed's env:// rendezvous, for a job without servers: worker 0's host and a port
        master = None
        if config.master_port is not None:
            master = (torch_master_address(config, next(h for r, _, h in placed if r == "worker")), config.master_port)
        return cls(config, root_uri, settings, command_argv(config.command, config.python), secrets,
                   local_only or all(h.is_loopback for h in config.hosts), local_only,
                   config.sync_dst_dir or config.cwd, master, all_through_launcher)

    def spec(self, role: str, rank: int, host: Host, local_rank: int, local_size: int, threads: int | None,
             slot: tuple[int, int] | None) -> ProcessSpec:
        """Process ``role`` ``rank`` on ``host``: the ``local_rank``-th of ``local_size`` of its role
        there, with ``threads`` per pool (None: unset) and ``slot`` of the cores (``--cpu-bind``)."""
        config = self.config
        on_launcher = (self.local_only or host is LOCAL_HOST) and not self.all_through_launcher
        script = None
        node_role = "server" if role == "replica" else role  # a replica is a server process (DMLC_ROLE=server)
        if role == "worker" or config.user_command_for_all_roles:
            argv = self.user_argv
            script = script_of(config.command)
        else:
            argv = runtime_argv(node_role, config.python)
        # Otherwise each node advertises its interface toward the scheduler (or --interface's),
        # found on its own host: an address of the hostfile may be on another network.
        node_host = None
        if not config.interface:
            if on_launcher and host is LOCAL_HOST:
                node_host = "127.0.0.1" if self.all_local else None
            elif host.is_loopback and host.is_ip:
                node_host = host.name  # 127.0.0.2, 127.0.0.3: distinct hosts on one machine
        env = ec.contract_env(
            role=node_role,
            root_uri=self.root_uri,
            root_port=config.scheduler_port,
            num_workers=config.num_workers,
            num_servers=config.num_servers,
            job_id=config.job_id,
            rank=rank,
            local_rank=local_rank,
            local_size=local_size,
            node_host=node_host,
            interface=config.interface,
            all_local=self.all_local,
            verbose=config.verbose if config.verbose > 1 else 0,
            settings=self.settings,
        )
        if role == "worker":  # a plain torch script runs as under torchrun
            env.update(ec.torch_env(rank=rank, world_size=config.num_workers, local_rank=local_rank,
                                    local_world_size=local_size, master=self.master,
                                    gpus_per_worker=config.gpus_per_worker, max_restarts=config.max_restarts,
                                    run_id=config.job_id))
        if role == "replica":
            env[ec.PSLAUNCH_SERVER_REPLICA] = "1"
        if threads is not None:
            env.update({name: str(threads) for name in THREAD_VARIABLES})
        if slot is not None:
            env[ec.PSLAUNCH_CPU_BIND] = f"{config.cpu_bind}:{slot[0]}:{slot[1]}"
        # Python children write to pipes, which block-buffer print(): lines would arrive at exit.
        env["PYTHONUNBUFFERED"] = config.python_unbuffered
        return ProcessSpec(
            role=role,
            rank=rank,
            host=host,
            argv=argv,
            env=env,
            user_env=tuple(v for v in config.env if v.applies_to(node_role)) + self.secrets,
            local_rank=local_rank,
            local_size=local_size,
            cwd=_cwd(config, host, on_launcher, self.remote_cwd),
            on_launcher=on_launcher,
            script=script,
        )


def joiner_spec(config: LaunchConfig, plan: Plan, host: Host, rank: int, local_rank: int, local_size: int) -> ProcessSpec:
    """A worker that joins the running elastic job on ``host`` (``launcher.supervision.elastic``), as
    ``make_plan`` would have placed it there: worker ``rank`` (``DMLC_WORKER_ID``), the
    ``local_rank``-th of ``local_size`` on its host."""
    workers = [("worker", p.rank, p.host) for p in plan.processes if p.role == "worker"]
    shared = _Shared.of(config, plan.root_uri, workers or [("worker", rank, host)], False)
    # on this machine it takes the share of the cores the others got (``thread_share``)
    here = host is LOCAL_HOST or host.is_loopback
    threads = next((p.env.get(THREAD_VARIABLES[0]) for p in plan.processes
                    if here and (p.host is LOCAL_HOST or p.host.is_loopback) and THREAD_VARIABLES[0] in p.env), None)
    return shared.spec("worker", rank, host, local_rank, local_size, None if threads is None else int(threads), None)


#: What sizes the thread pools of OpenMP, MKL and OpenBLAS (numpy's, torch's) in each process.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or a Slurm step's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_slots(placed: list[tuple[str, int, Host]]) -> list[tuple[int, int]]:
    """``(index, count)`` of each placed process among the job's processes that share its machine's
    cores (``--cpu-bind``): those on this machine (every loopback "host" too) together, and each
    other host's apart."""
    def machine(host: Host) -> object:
        return "here" if host is LOCAL_HOST or host.is_loopback else (host.user, host.name, host.port)

    totals: dict[object, int] = {}
    for _, _, host in placed:
        totals[machine(host)] = totals.get(machine(host), 0) + 1
    seen: dict[object, int] = {}
    slots = []
    for _, _, host in placed:
        index = seen.get(machine(host), 0)
        seen[machine(host)] = index + 1
        slots.append((index, totals[machine(host)]))
    return slots


def thread_share(config: LaunchConfig, placed: list[tuple[str, int, Host]]) -> tuple[dict[Host, int], tuple[str, ...]]:
    """Threads per process for the job's processes on this machine when it runs several of them, as
    torchrun does: without it each one sizes its pools to every core, and N processes on C cores run
    N x C threads. The cores divided by the processes (those of every loopback "host" too: they
    share this machine's cores), at least 1; nothing when the user set any of ``THREAD_VARIABLES``
    (in pslaunch's environment, ``config.threads_chosen``, or ``--env``), or for other machines,
    whose cores pslaunch does not know. Returns ``({host: threads}, the line saying so)``."""
    if config.threads_chosen or {v.name for v in config.env} & set(THREAD_VARIABLES):
        return {}, ()
    here = [host for _, _, host in placed if host is LOCAL_HOST or host.is_loopback]
    if len(here) < 2:
        return {}, ()
    cores = usable_cores()
    each = max(1, cores // len(here))
    told = ", ".join(f"{name}={each}" for name in THREAD_VARIABLES)
    return ({host: each for host in here},
            (f"{len(here)} processes share this machine's {cores} cores: each gets {told} "
             "(set OMP_NUM_THREADS to choose; docs/launcher.md)",))


def settings_left_note(names: tuple[str, ...]) -> tuple[str, ...]:
    """The line saying that settings in pslaunch's own environment do not reach the job (none when
    there are none): each must be the same in every process, which only ``--env`` gives on every
    backend, so pslaunch's children do not inherit them."""
    if not names:
        return ()
    if len(names) == 1:
        said, how = f"{names[0]} is", f"give it with --env {names[0]}"
    else:
        said, how = f"{', '.join(names)} are", "give each with --env NAME"
    return (f"{said} set in pslaunch's environment but not passed to the job: a setting must be the same in "
            f"every process, so {how} (docs/env.md)",)


def format_plan(plan: Plan) -> str:
    """The plan as text for ``--dry-run``: each process, its host, argv and environment.

    Contract variables are shown with their values; ``--env`` variables by name only.
    """
    servers = len(plan.by_role("server"))
    lines = [
        f"job {plan.job_id}: backend {plan.backend}, scheduler at {plan.root_uri}:{plan.root_port}, "
        f"{servers} server(s), {len(plan.by_role('worker'))} worker(s)"
    ]
    if not servers:
        lines.append("allreduce mode: no servers; the scheduler does registration, heartbeats and barriers, "
                     "the workers sum among themselves (kvcore.create('allreduce'))")
    for p in plan.processes:
        where = "this machine" if p.on_launcher else plan.backend
        lines.append(f"{p.name}  (local rank {p.local_rank}/{p.local_size}, via {where})")
        lines.append(f"    argv: {shlex.join(p.argv)}")
        if p.cwd:
            lines.append(f"    cwd:  {p.cwd}")
        lines.append("    env:  " + " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items()))
        named = [v.name for v in p.user_env if v.name != ec.PSLAUNCH_JOB_KEY]
        if named:
            lines.append("    --env (values hidden): " + " ".join(named))
        if len(named) < len(p.user_env):
            lines.append(f"    the job key: on a file descriptor ({ec.PSLAUNCH_JOB_KEY_FD}), in no argv or environment")
    lines += list(plan.notes)
    return "\n".join(lines)
