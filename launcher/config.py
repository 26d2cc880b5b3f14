"""The launch configuration: everything the CLI parsed, as one frozen value.

``LaunchConfig`` is what ``launcher.planning.plan.make_plan`` turns into a plan. It holds no open files,
sockets or processes; ``resolve`` fills in the few values that need a look at the machine (a free
scheduler port, the launching host's address) so that planning itself stays pure.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from pscontract import RESTART_SCOPES, free_port

from .errors import ConfigError

__all__ = [
    "SshOptions",
    "SlurmOptions",
    "SgeOptions",
    "RayOptions",
    "AgentOptions",
    "OPTION_GROUPS",
    "Host",
    "LOCAL_HOST",
    "EnvVar",
    "LaunchConfig",
    "parse_env_option",
    "free_port",
    "parse_ranks_option",
    "DEFAULT_STOP_GRACE",
    "DEFAULT_SHUTDOWN_GRACE",
    "parse_metrics_option",
    "DEFAULT_LINK_TIMEOUT",
    "DEFAULT_RDZV_TIMEOUT",
    "parse_endpoint",
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Seconds between TERM and KILL when the launcher stops a process.
DEFAULT_STOP_GRACE = 5.0
#: Seconds a scheduler or server that is not the bundled runtime gets to exit once every worker exited 0.
DEFAULT_SHUTDOWN_GRACE = 10.0
#: Seconds of silence after which a remote host is lost and its guards stop their processes.
DEFAULT_LINK_TIMEOUT = 15.0
#: Seconds the per-node agents have to find each other (``--rdzv-timeout``).
DEFAULT_RDZV_TIMEOUT = 300.0


@dataclass(frozen=True)
class Host:
    """One host of the job.

    ``name`` is what ssh connects to (an address or a name, possibly an alias of ~/.ssh/config);
    ``user`` and ``port`` are None when the hostfile leaves them to ssh's defaults / --ssh-user /
    --ssh-port; ``slots`` is None for "no limit".
    """

    name: str
    user: str | None = None
    port: int | None = None
    slots: int | None = None
    #: ``FILE:LINE`` of the hostfile line that named the host first, for errors (None: not from a file)
    where: str | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """The host as shown in output prefixes and tables (the name, IPv6 in brackets)."""
        return f"[{self.name}]" if ":" in self.name else self.name

    @property
    def is_ip(self) -> bool:
        """True when ``name`` is an IPv4 or IPv6 literal."""
        try:
            ipaddress.ip_address(self.name)
        except ValueError:
            return False
        return True

    @property
    def is_loopback(self) -> bool:
        """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
        if self.name == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.name).is_loopback
        except ValueError:
            return False


#: The host pslaunch runs on (scheduler placement, the local backend).
LOCAL_HOST = Host("localhost")


@dataclass(frozen=True)
class EnvVar:
    """One ``--env``/``--env-server``/``--env-worker`` variable.

    ``scope`` is ``all``, ``server`` or ``worker`` (``server`` also covers the scheduler, as in
    MXNet's launch.py). The value is left out of ``repr`` because it may be a secret.
    """

    name: str
    value: str = field(repr=False)
    scope: str = "all"

    def applies_to(self, role: str) -> bool:
        """Whether a process of ``role`` gets this variable."""
        if self.scope == "all":
            return True
        if self.scope == "worker":
            return role == "worker"
        return role in ("server", "scheduler")


def parse_env_option(text: str, scope: str, environ: dict[str, str]) -> EnvVar:
    """Parse one ``--env`` value: ``NAME:VALUE``, ``NAME=VALUE`` or ``NAME`` (forward own value).

    The name ends at the first ``:`` or ``=``; the value is kept verbatim. Raises ``ConfigError``
    naming the flag and the name (never the value) for a bad name or a ``NAME`` that is not set in
    ``environ``.
    """
    cut = min((i for i in (text.find(":"), text.find("=")) if i >= 0), default=-1)
    name, value = (text, None) if cut < 0 else (text[:cut], text[cut + 1 :])
    flag = "--env" if scope == "all" else f"--env-{scope}"
    if not _ENV_NAME.match(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise ConfigError(f"{flag}: {shown!r} is not a variable name (expected NAME:VALUE, NAME=VALUE or NAME)")
    if value is None:
        if name not in environ:
            raise ConfigError(f"{flag} {name}: forwards pslaunch's own {name}, but it is not set here")
        value = environ[name]
    return EnvVar(name, value, scope)


def parse_ranks_option(text: str) -> frozenset[int]:
    """``--ranks 0,3-5`` as the set of ranks it names.

    Raises ``ConfigError`` naming the value when a piece is not a rank or a range ``A-B`` with A <= B.
    """
    ranks: set[int] = set()
    for piece in text.split(","):
        low, dash, high = piece.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ConfigError(f"--ranks {text!r}: {piece.strip()!r} is not a rank or a range of ranks "
                              "(e.g. --ranks 0,3-5)")
        ranks.update(range(int(low), int(high if dash else low) + 1))
    return frozenset(ranks)


def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) as ``(host, port)``.

    Raises ``ConfigError`` naming ``flag`` and the value when the host or the port is missing or
    the port is not in 1..65535."""
    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{flag} {text!r}: expected HOST:PORT with a port in 1..65535, e.g. "
                          "pslaunch-0.pslaunch:29400 or 10.0.0.1:29400")
    return host, int(port)


def parse_metrics_option(text: str) -> tuple[str, int]:
    """``--metrics-port [ADDR:]PORT`` as ``(address, port)``; the address defaults to 127.0.0.1.

    Raises ``ConfigError`` naming the value when the port is not a number.
    """
    address, _, port = text.rpartition(":")
    address = address.strip("[]") or "127.0.0.1"
    if not port.isdigit():
        raise ConfigError(f"--metrics-port {text!r}: expected PORT or ADDRESS:PORT, e.g. 9400 or 0.0.0.0:9400")
    return address, int(port)


@dataclass(frozen=True)
class SshOptions:
    """How pslaunch reaches hosts over ssh (``--launcher ssh``; ``mpi``'s daemons use them too)."""

    port: int | None = None  # --ssh-port: for hosts whose line gives none
    user: str | None = None  # --ssh-user
    identity: str | None = None  # -i/--identity: a private key file (absolute)
    config: str | None = None  # --ssh-config (default ~/.ssh/config)
    known_hosts: str | None = None  # --known-hosts
    host_key_policy: str = "accept-new"  # --host-key-policy accept-new|strict|ignore
    connect_timeout: float = 10.0  # --connect-timeout: seconds for each host's pre-flight check


@dataclass(frozen=True)
class SlurmOptions:
    """``--launcher slurm``'s options."""

    args: str | None = None  # --slurm-args: options of the allocation or job step (shell syntax)


@dataclass(frozen=True)
class SgeOptions:
    """``--launcher sge``'s options."""

    args: str | None = None  # --sge-args: qsub options
    pe: str | None = None  # --sge-pe: the parallel environment (default smp)


@dataclass(frozen=True)
class RayOptions:
    """``--launcher ray``'s options, as given (``launcher.backends.ray.settings`` checks them)."""

    address: str | None = None  # --ray-address
    strategy: str | None = None  # --ray-strategy spread|pack
    worker_resources: str | None = None  # --ray-worker-resources JSON
    server_resources: str | None = None  # --ray-server-resources JSON
    timeout: str | None = None  # --ray-timeout SECONDS
    exclude: tuple[str, ...] = ()  # --ray-exclude PATTERN...


@dataclass(frozen=True)
class AgentOptions:
    """The per-node agents' options (``--nnodes``: the same command on every node, no ssh between them)."""

    nnodes: int | None = None  # --nnodes: None without agents (with MIN:MAX, the most)
    min_nnodes: int = 0  # --nnodes MIN:MAX: nodes 0..MIN-1 form the job, MIN..MAX-1 may join and leave (0: fixed)
    node_rank: int = 0  # --node-rank (PSLAUNCH_NODE_RANK, JOB_COMPLETION_INDEX)
    rdzv_endpoint: str | None = None  # --rdzv-endpoint HOST:PORT: where node 0 listens for the agents
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT  # --rdzv-timeout


#: The option groups of ``LaunchConfig``, by the field that holds each: a backend names those it takes.
OPTION_GROUPS = {"ssh": SshOptions, "slurm": SlurmOptions, "sge": SgeOptions, "ray": RayOptions, "agents": AgentOptions}


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a launch needs, as parsed from the command line. See ``pslaunch --help``.

    The job's shape and what every backend reads lie flat; what only some backends read is in a
    typed group of its own (``ssh``, ``slurm``, ``sge``, ``ray``, ``agents``), which a backend names
    in ``Backend.takes`` (any other group given is refused before anything starts).
    """

    command: tuple[str, ...]
    num_workers: int
    num_servers: int
    backend: str = "local"
    hosts: tuple[Host, ...] = ()
    user_command_for_all_roles: bool = False
    python: str = "python3"
    python_unbuffered: str = "1"
    env: tuple[EnvVar, ...] = ()
    scheduler_host: str | None = None
    scheduler_port: int | None = None
    launch_address: str = "127.0.0.1"
    interface: str | None = None
    link_timeout: float = DEFAULT_LINK_TIMEOUT
    sync_dst_dir: str | None = None
    sync_src_dir: str = "."
    cwd: str | None = None
    log_dir: str | None = None
    ranks: frozenset[int] | None = None  # --ranks: the workers whose lines the console shows (None: all)
    timestamps: bool = False  # --timestamps: each console line starts with the time it arrived
    timeout: float | None = None
    stop_grace: float = DEFAULT_STOP_GRACE
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    job_id: str = "job"
    job_key: str = field(default="", repr=False)  # the job's secret (PSLAUNCH_JOB_KEY); never printed
    encrypt: bool = False
    max_restarts: int = 0
    checkpoint_dir: str | None = None  # absolute
    allow_restart_from_scratch: bool = False
    restart_scope: str = "job"
    server_replicas: int = 0  # --server-replicas: processes that hold a copy of each server's keys
    stall_warn: float = 60.0  # --stall-warn: seconds a round or barrier waits before the log says so (0: never)
    stall_timeout: float = 0.0  # --stall-timeout: seconds a stalled wait may last before the job ends (0: never)
    cpu_bind: str = "none"  # --cpu-bind: none, cores (a block of its host's cores each) or numa (a node each)
    min_workers: int = 0  # -n MIN:MAX: an elastic job goes on with MIN (0, or num_workers: not elastic)
    elastic_timeout: float = 60.0  # --elastic-timeout: seconds below MIN workers before the job fails
    hostfile: str | None = None  # -H's path: an elastic ssh job reads it again when it changes
    host_discovery_script: str | None = None  # --host-discovery-script: an elastic ssh job's hosts, asked again
    threads_chosen: bool = False  # pslaunch's environment sets OMP_NUM_THREADS (or MKL's, OpenBLAS's): no default
    # settings (``pscontract.SETTINGS``) pslaunch's environment holds that no --env gives the job: they do
    # not reach its processes (a setting must be the same in all of them), and pslaunch says so
    settings_left: tuple[str, ...] = ()
    verbose: int = 0
    quiet: bool = False
    dry_run: bool = False
    dashboard: bool = False  # the live table (decided by the CLI: on a terminal unless --no-dashboard)
    metrics_address: str = "127.0.0.1"
    metrics_port: int | None = None
    summary_json: str | None = None
    timeline: str | None = None
    gpus_per_worker: int | None = None  # --gpus-per-worker: CUDA_VISIBLE_DEVICES by local rank
    master_port: int | None = None  # torch's MASTER_PORT on worker 0's host (resolved)
    ssh: SshOptions = SshOptions()
    slurm: SlurmOptions = SlurmOptions()
    sge: SgeOptions = SgeOptions()
    ray: RayOptions = RayOptions()
    agents: AgentOptions = AgentOptions()

    @property
    def wants_stats(self) -> bool:
        """Whether pslaunch needs the runtime's counters (``PSLAUNCH_STATS``): for the dashboard,
        the metrics endpoint or the summary JSON."""
        return self.dashboard or self.metrics_port is not None or self.summary_json is not None

    @property
    def elastic(self) -> bool:
        """``-n MIN:MAX`` with MIN below MAX: workers may leave the running job."""
        return 0 < self.min_workers < self.num_workers

    @property
    def start_workers(self) -> int:
        """The workers the job starts with: ``num_workers``, or for an elastic job on hosts that all
        give ``slots`` (over ssh, or the agents' first nodes), as many as those take (at most MAX);
        the others join when slots appear."""
        if (not self.elastic or self.backend not in ("ssh", "agents") or not self.hosts
                or any(h.slots is None for h in self.hosts)):
            return self.num_workers
        return min(self.num_workers, sum(h.slots or 0 for h in self.hosts))

    def _check_elastic(self) -> None:
        shape = f"-n {self.min_workers}:{self.num_workers}"
        if self.backend in ("mpi", "slurm", "sge"):
            raise ConfigError(f"{shape} makes the job elastic, but --launcher {self.backend} starts every rank at once "
                              "and ends them together: use --launcher local, ssh or per-node agents (--nnodes)")
        if self.backend not in ("local", "ssh", "agents"):
            raise ConfigError(f"{shape} makes the job elastic, which runs with --launcher local, ssh and per-node "
                              f"agents for now (--launcher {self.backend}: not yet)")
        if self.num_servers == 0:
            raise ConfigError(f"{shape} makes the job elastic, but -s 0 has no servers: the workers' rings would "
                              "have to be formed again at every change; give the job servers (-s N)")
        if self.server_replicas or self.restart_scope == "worker":
            raise ConfigError(f"{shape} makes the job elastic, which does not go with "
                              f"{'--server-replicas' if self.server_replicas else '--restart-scope worker'} yet")
        if not self.elastic_timeout >= 0:
            raise ConfigError(f"--elastic-timeout must be >= 0 seconds, got {self.elastic_timeout}")
        if self.start_workers < self.min_workers:
            raise ConfigError(f"{shape}: the {'first nodes' if self.backend == 'agents' else 'hostfile'}'s "
                              f"{self.start_workers} slots ("
                              + ", ".join(f"{h.label} slots={h.slots}" for h in self.hosts)
                              + f") hold fewer than the job's minimum of {self.min_workers} workers")

    def advice(self) -> list[str]:
        """What pslaunch warns about in a config it runs anyway: more servers than workers."""
        if self.num_servers > self.num_workers:
            return [f"-s {self.num_servers} starts more servers than there are workers (-n {self.num_workers}): a "
                    "server holds a share of every key and answers every worker, so servers beyond the workers add "
                    "processes and messages, rarely speed; -s defaults to -n"]
        return []

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no COMMAND given: write it after the options, e.g. `pslaunch -n 2 python train.py`")
        if self.num_workers < 1:
            raise ConfigError(f"-n/--num-workers must be >= 1, got {self.num_workers}")
        if self.num_servers < 0:
            raise ConfigError(f"-s/--num-servers must be >= 0 (0: no servers, the workers sum among themselves "
                              f"with kvcore.create('allreduce')), got {self.num_servers}")
        if self.elastic:
            self._check_elastic()
        if self.host_discovery_script and not (self.elastic and self.backend == "ssh"):
            shape = f"{self.min_workers}:{self.num_workers}" if self.elastic else str(self.num_workers)
            raise ConfigError("--host-discovery-script gives an elastic job its hosts: it needs -n MIN:MAX and "
                              f"--launcher ssh (here -n {shape}, --launcher {self.backend})")
        outside = sorted(r for r in self.ranks or () if r >= self.num_workers)
        if outside:
            raise ConfigError(f"--ranks names worker rank(s) {', '.join(map(str, outside))}, but the job has "
                              f"{self.num_workers} worker(s): ranks 0..{self.num_workers - 1}")
        if self.scheduler_port is not None and not 1 <= self.scheduler_port <= 65535:
            raise ConfigError(f"--scheduler-port must be in 1..65535, got {self.scheduler_port}")
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout}")
        for flag, value in (("--stop-grace", self.stop_grace), ("--shutdown-grace", self.shutdown_grace),
                            ("--connect-timeout", self.ssh.connect_timeout), ("--link-timeout", self.link_timeout)):
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0 seconds, got {value}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 1:
            raise ConfigError(f"--gpus-per-worker must be >= 1, got {self.gpus_per_worker}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 1..65535, got {self.metrics_port}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if (self.max_restarts and not self.checkpoint_dir and not self.allow_restart_from_scratch
                and self.restart_scope != "worker"):  # a worker replaced in place needs no checkpoint
            where = ("a directory every server host reaches) so that the job resumes from its last checkpoint"
                     if self.num_servers else "a directory every worker reaches, given to them as PSLAUNCH_CHECKPOINT_DIR) "
                     "where the script saves its checkpoints and finds them again when TORCHELASTIC_RESTART_COUNT or "
                     "PSLAUNCH_RESTART_COUNT says it was restarted")
            raise ConfigError(
                f"--max-restarts {self.max_restarts} without --checkpoint-dir: every restart would begin the training "
                f"from scratch; give --checkpoint-dir DIR ({where}, or --allow-restart-from-scratch")
        if self.restart_scope not in RESTART_SCOPES:
            raise ConfigError(f"--restart-scope must be {' or '.join(RESTART_SCOPES)}, got {self.restart_scope!r}")
        if self.restart_scope == "worker" and not self.max_restarts:
            raise ConfigError("--restart-scope worker restarts a failed worker alone, which needs --max-restarts N "
                              "(N > 0)")
        if self.restart_scope == "worker" and self.num_servers == 0:
            raise ConfigError("--restart-scope worker with -s 0: a job without servers keeps its model on the workers "
                              "(a ring, or torch's process group), which a worker started again alone cannot rejoin; "
                              "use --restart-scope job with --checkpoint-dir, or give the job servers (-s N)")
        if self.restart_scope == "worker" and self.user_command_for_all_roles:
            raise ConfigError("--restart-scope worker needs the bundled runtime, which lets a restarted worker rejoin; "
                              "with --command-for-all-roles use --restart-scope job")
        if self.stall_warn < 0:
            raise ConfigError(f"--stall-warn must be >= 0 seconds (0: never), got {self.stall_warn}")
        if not self.stall_timeout >= 0:
            raise ConfigError(f"--stall-timeout must be >= 0 seconds (0: never), got {self.stall_timeout}")
        if not 0 <= self.server_replicas <= 8:
            raise ConfigError(f"--server-replicas must be between 0 and 8, got {self.server_replicas}")
        if self.server_replicas and self.num_servers == 0:
            raise ConfigError(f"--server-replicas {self.server_replicas} keeps copies of the servers' keys, but -s 0 "
                              "starts no servers (the workers hold the model)")
        if self.server_replicas and self.user_command_for_all_roles:
            raise ConfigError("--server-replicas needs the bundled runtime's servers; with --command-for-all-roles "
                              "the servers are the command's")
        if self.agents.nnodes is not None:
            if self.agents.nnodes < 1:
                raise ConfigError(f"--nnodes must be >= 1, got {self.agents.nnodes}")
            if self.agents.min_nnodes and not self.elastic:
                raise ConfigError(f"--nnodes {self.agents.min_nnodes}:{self.agents.nnodes} lets nodes join and leave the "
                                  f"running job, which needs an elastic job: give -n MIN:MAX too (here -n {self.num_workers})")
            if not 0 <= self.agents.node_rank < self.agents.nnodes:
                raise ConfigError(f"--node-rank {self.agents.node_rank} is not a node of --nnodes {self.agents.nnodes}: "
                                  f"ranks are 0..{self.agents.nnodes - 1}")
            if not self.agents.rdzv_endpoint:
                raise ConfigError(f"--nnodes {self.agents.nnodes} needs --rdzv-endpoint HOST:PORT, the address of node 0 "
                                  "that every node reaches (node 0 listens there)")
            parse_endpoint(self.agents.rdzv_endpoint)
            if self.agents.rdzv_timeout <= 0:
                raise ConfigError(f"--rdzv-timeout must be > 0 seconds, got {self.agents.rdzv_timeout}")
        if self.ssh.host_key_policy not in ("accept-new", "strict", "ignore"):
            raise ConfigError(f"--host-key-policy must be accept-new, strict or ignore, got {self.ssh.host_key_policy!r}")


