"""Every option of the ``pslaunch`` command, once: its flags, kind, default, help and section.

The command line (``launcher.cli``) makes its click options from ``OPTIONS``; ``launch()``
(``launcher.api``) reads its keywords by the same names with ``read_value``, the same conversions
without click; ``build_config`` turns either's values into a ``LaunchConfig``, each backend's
options into the typed group it takes (``launcher.config``). So an option is added in one place:
a row here, and the field it fills.
"""

from __future__ import annotations

import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import pscontract as ec
from pscontract import new_job_key

from .config import (
    DEFAULT_RDZV_TIMEOUT,
    AgentOptions,
    LaunchConfig,
    RayOptions,
    SgeOptions,
    SlurmOptions,
    SshOptions,
    parse_endpoint,
    parse_env_option,
    parse_metrics_option,
    parse_ranks_option,
)
from .errors import ConfigError
from .planning.capacity import CapacityError, DiscoveryScript
from .planning.hostfile import parse_hostfile

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["Option", "OPTIONS", "SECTIONS", "defaults", "read_value", "build_config", "refuse_unused"]

#: The option groups that one backend reads, the backend of the same name.
OWN_GROUPS = ("slurm", "sge", "ray", "agents")

#: ``--help``'s sections, in order.
SECTIONS = ("Job shape", "Hosts and ssh", "Batch systems", "Ray clusters", "Nodes without ssh", "Output",
            "Ending and restarts", "Security", "Observability")


@dataclass(frozen=True)
class Option:
    """One option of the command. ``kind``: ``int``, ``float``, ``text``, ``path`` (a file or, with
    ``file_okay`` False, a directory), ``choice`` (one of ``choices``), ``flag`` (on when given),
    ``toggle`` (``--x`` / ``off``: True, False, or None when neither) or ``count`` (``-vv``: 2).
    ``group``: the option group of ``LaunchConfig`` it fills (``ssh``, ``slurm``, ``sge``, ``ray``,
    ``agents``); an option of the ``slurm``, ``sge``, ``ray`` or ``agents`` group is read by the backend
    of that name only."""

    name: str
    flags: tuple[str, ...]
    kind: str
    default: Any = None
    help: str = ""
    section: str = "Other"
    off: tuple[str, ...] = ()
    multiple: bool = False
    required: bool = False
    metavar: str | None = None
    show_default: bool | str = False
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    dir_okay: bool = True
    file_okay: bool = True
    group: str | None = None

    @property
    def shown(self) -> str:
        """How a message names it: ``-n/--num-workers``."""
        return "/".join(self.flags)

    @property
    def empty(self) -> Any:
        """Its value when not given: ``()`` for a repeatable option, 0 for a count, False for a flag."""
        if self.multiple:
            return ()
        if self.kind == "count":
            return 0
        if self.kind == "flag":
            return False
        return self.default


OPTIONS: tuple[Option, ...] = (
    # -- Job shape
    Option('num_workers', ('-n', '--num-workers'), 'workers', required=True, metavar='N|MIN:MAX', section='Job shape', help='Number of worker processes; MIN:MAX makes the job elastic: workers that get SIGTERM leave at a step boundary while MIN remain, and workers join on capacity that appears (local: MAX start; ssh: as many as the slots hold, the hostfile read again or --host-discovery-script; agents: --nnodes MIN:MAX; dist_sync with servers).'),
    Option('num_servers', ('-s', '--num-servers'), 'int', section='Job shape', help="Number of servers [default: = workers]; 0: none, the workers sum among themselves (kvcore.create('allreduce'))."),
    Option('backend', ('--launcher',), 'text', metavar='NAME', section='Job shape', help='Backend: local, ssh, mpi, slurm, sge or ray [default: ssh with a hostfile, local without].'),
    Option('command_for_all_roles', ('--command-for-all-roles',), 'flag', section='Job shape', help='Run COMMAND as scheduler and servers too (MXNet / ps-lite / BytePS programs) instead of the bundled runtime `python -m psnode`.'),
    Option('python', ('--python',), 'text', default=sys.executable, show_default='this Python', section='Job shape', help='Interpreter for a COMMAND starting with python, python3 or a .py file, and for the bundled runtime.'),
    Option('env_all', ('-x', '--env'), 'text', multiple=True, metavar='NAME[:VALUE]', section='Job shape', help="Set NAME for every process (NAME=VALUE too, as mpirun's -x); NAME alone forwards pslaunch's own value. Repeatable."),
    Option('env_server', ('--env-server',), 'text', multiple=True, metavar='NAME[:VALUE]', section='Job shape', help='Like --env, for scheduler and servers.'),
    Option('env_worker', ('--env-worker',), 'text', multiple=True, metavar='NAME[:VALUE]', section='Job shape', help='Like --env, for workers.'),
    Option('gpus_per_worker', ('--gpus-per-worker',), 'int', metavar='K', minimum=1, section='Job shape', help='Give each worker K GPUs of its host: CUDA_VISIBLE_DEVICES from its local rank (local rank r gets GPUs r*K .. r*K+K-1) [default: CUDA_VISIBLE_DEVICES untouched].'),
    Option('scheduler_host', ('--scheduler-host',), 'text', section='Job shape', help='Run the scheduler on this host [default: here].'),
    Option('scheduler_port', ('--scheduler-port',), 'int', section='Job shape', help='Scheduler port [default: a free one].'),
    Option('interface', ('--interface',), 'text', metavar='NAME[,NAME...]|NETWORK', section='Job shape', help='The interface whose address each node advertises, resolved on each host: a name, names tried in order (ib0,eth0) or an IPv4 network (10.1.0.0/16) [default: toward the scheduler].'),
    Option('job_id', ('--job-id',), 'text', section='Job shape', help='Job id (PSLAUNCH_JOB_ID) [default: random].'),
    # -- Hosts and ssh
    Option('hostfile', ('-H', '--hostfile'), 'path', dir_okay=False, section='Hosts and ssh', help='Hosts to run on: `[user@]host[:sshport] [slots=N]` per line.'),
    Option('sync_dst_dir', ('--sync-dst-dir',), 'text', metavar='DIR', section='Hosts and ssh', help='rsync the current directory to DIR on every host first; processes start there.'),
    Option('ssh_port', ('--ssh-port',), 'int', section='Hosts and ssh', group='ssh', help='ssh port for hosts whose line gives none.'),
    Option('ssh_user', ('--ssh-user',), 'text', section='Hosts and ssh', group='ssh', help='ssh user for hosts whose line gives none.'),
    Option('identity', ('-i', '--identity'), 'path', dir_okay=False, section='Hosts and ssh', group='ssh', help='ssh private key file.'),
    Option('ssh_config', ('--ssh-config',), 'path', dir_okay=False, section='Hosts and ssh', group='ssh', help='ssh client config [default: ~/.ssh/config].'),
    Option('known_hosts', ('--known-hosts',), 'path', dir_okay=False, section='Hosts and ssh', group='ssh', help='Where accepted host keys are recorded [default: ~/.ssh/known_hosts].'),
    Option('host_key_policy', ('--host-key-policy',), 'choice', default='accept-new', show_default=True, choices=('accept-new', 'strict', 'ignore'), section='Hosts and ssh', group='ssh', help='Unknown host keys: record them, refuse them, or neither.'),
    Option('connect_timeout', ('--connect-timeout',), 'float', default=10.0, show_default=True, section='Hosts and ssh', group='ssh', help="Seconds for each host's pre-flight ssh check."),
    Option('link_timeout', ('--link-timeout',), 'float', default=15.0, show_default=True, section='Hosts and ssh', help='Seconds without a word between pslaunch and a remote host after which the host is lost and its processes are stopped there (0: never).'),
    # -- Batch systems
    Option('slurm_args', ('--slurm-args',), 'text', metavar='ARGS', section='Batch systems', group='slurm', help='Slurm options for the allocation pslaunch asks for, or for its job step inside an allocation: partition, account, time, ... (--launcher slurm).'),
    Option('sge_args', ('--sge-args',), 'text', metavar='ARGS', section='Batch systems', group='sge', help='qsub options: queue, resources, project, ... (--launcher sge).'),
    Option('sge_pe', ('--sge-pe',), 'text', metavar='NAME', section='Batch systems', group='sge', help='SGE parallel environment the job asks slots of [default: smp] (--launcher sge).'),
    # -- Ray clusters
    Option('ray_address', ('--ray-address',), 'text', metavar='ADDRESS', section='Ray clusters', group='ray', help='The Ray cluster to run on (--launcher ray) [default: $RAY_ADDRESS, then auto: the cluster this machine is a node of].'),
    Option('ray_strategy', ('--ray-strategy',), 'choice', choices=('spread', 'pack'), section='Ray clusters', group='ray', help='How the placement group spreads the processes over the nodes: spread (servers on distinct nodes when it can) or pack [default: spread] (--launcher ray).'),
    Option('ray_worker_resources', ('--ray-worker-resources',), 'text', metavar='JSON', section='Ray clusters', group='ray', help='What each worker asks of Ray, e.g. \'{"CPU": 1, "GPU": 1}\' [default: {"CPU": 1}] (--launcher ray).'),
    Option('ray_server_resources', ('--ray-server-resources',), 'text', metavar='JSON', section='Ray clusters', group='ray', help='What each server asks of Ray [default: {"CPU": 1}] (--launcher ray).'),
    Option('ray_timeout', ('--ray-timeout',), 'text', metavar='SECONDS', section='Ray clusters', group='ray', help="Seconds Ray has to place the job's placement group; then the missing resources are named [default: 60; without it a group the cluster's own resources can never hold is refused at once] (--launcher ray)."),
    Option('ray_exclude', ('--ray-exclude',), 'text', multiple=True, metavar='PATTERN', section='Ray clusters', group='ray', help="Leave what PATTERN matches (a .gitignore line) out of the working directory Ray uploads to every node; repeatable. Past Ray's 512 MiB package limit pslaunch refuses before zipping anything, naming the biggest entries (--launcher ray)."),
    # -- Nodes without ssh
    Option('nnodes', ('--nnodes',), 'workers', metavar='N|MIN:MAX', section='Nodes without ssh', group='agents', help="Run as one of N per-node agents: the same command on every node, no ssh between them; node 0 runs the scheduler and the job's table (-n and -s stay totals, spread over the nodes). MIN:MAX (with -n MIN:MAX): nodes MIN..MAX-1 may join and leave the running job."),
    Option('node_rank', ('--node-rank',), 'int', metavar='R', section='Nodes without ssh', group='agents', help="This node's rank, 0..N-1 [default: $PSLAUNCH_NODE_RANK, then Kubernetes' $JOB_COMPLETION_INDEX]."),
    Option('rdzv_endpoint', ('--rdzv-endpoint',), 'text', metavar='HOST:PORT', section='Nodes without ssh', group='agents', help="Node 0's address, which every node reaches: node 0's agent listens at PORT, its scheduler at PORT+1 (unless --scheduler-port)."),
    Option('rdzv_timeout', ('--rdzv-timeout',), 'float', default=300.0, show_default=True, section='Nodes without ssh', group='agents', help='Seconds the agents have to find each other; a node missing then is named.'),
    # -- Output
    Option('log_dir', ('--log-dir',), 'path', file_okay=False, section='Output', help='Keep one log file per process here.'),
    Option('ranks', ('--ranks',), 'text', metavar='LIST', section='Output', help="Show only these workers' lines, e.g. 0,3-5 (the scheduler's and servers' lines, the log files and the summary keep everything)."),
    Option('timestamps', ('--timestamps',), 'flag', section='Output', help='Start each line of a process with the time it arrived (HH:MM:SS.mmm).'),
    Option('verbose', ('-v', '--verbose'), 'count', default=0, section='Output', help='More about what pslaunch does; -vv also sets PS_VERBOSE.'),
    Option('quiet', ('-q', '--quiet'), 'flag', section='Output', help='Only the root cause of a failure; no output lines, no table.'),
    Option('dry_run', ('--dry-run',), 'flag', section='Output', help='Print the plan (hosts, argv, environment names) and exit.'),
    # -- Ending and restarts
    Option('timeout', ('--timeout',), 'float', section='Ending and restarts', help='Stop the job after this many seconds (exit 124).'),
    Option('stop_grace', ('--stop-grace',), 'float', default=5.0, show_default=True, section='Ending and restarts', help='Seconds between SIGTERM and SIGKILL when stopping processes.'),
    Option('shutdown_grace', ('--shutdown-grace',), 'float', default=10.0, show_default=True, section='Ending and restarts', help='Seconds a scheduler or server that is not the bundled runtime gets to exit after every worker exited 0 (bundled ones are asked to end at once).'),
    Option('max_restarts', ('--max-restarts',), 'int', default=0, metavar='N', show_default=True, section='Ending and restarts', help="Restart the job after a failure, N times at most in all (the count is the job's, PSLAUNCH_RESTART_COUNT); needs --checkpoint-dir or --allow-restart-from-scratch."),
    Option('checkpoint_dir', ('--checkpoint-dir',), 'text', metavar='DIR', section='Ending and restarts', help='Where the servers keep checkpoints (kvcore.elastic.State); every server host must reach it.'),
    Option('allow_restart_from_scratch', ('--allow-restart-from-scratch',), 'flag', section='Ending and restarts', help='Allow --max-restarts without --checkpoint-dir: a restarted job begins from scratch.'),
    Option('restart_scope', ('--restart-scope',), 'choice', default='job', show_default=True, choices=('job', 'worker'), section='Ending and restarts', help='What a restart starts again: every process, or only a failed worker (replaced in place, exactly, in dist_sync) or a failed scheduler, while the others go on.'),
    Option('server_replicas', ('--server-replicas',), 'int', default=0, metavar='K', show_default=True, section='Ending and restarts', help="Keep each server's keys on K more server processes (replicas, placed on other hosts): a lost server's replica takes its place and the job goes on, exactly (dist_sync, dist_device_sync)."),
    # -- Security
    Option('encrypt', ('--encrypt',), 'flag', section='Security', help="Encrypt every connection of the job (CurveZMQ, keys from the job's key); slower, for networks others can read."),
    # -- Observability
    Option('dashboard', ('--dashboard',), 'toggle', off=('--no-dashboard',), section='Observability', help='A live table of every process (state, rates, heartbeats; the straggler marked) below the output [default: on when stdout and stderr are a terminal; never otherwise].'),
    Option('metrics_port', ('--metrics-port',), 'text', metavar='[ADDR:]PORT', section='Observability', help="Serve the job's counters as Prometheus text at http://ADDR:PORT/metrics (ADDR 127.0.0.1 unless given) while the job runs."),
    Option('cpu_bind', ('--cpu-bind',), 'choice', default='none', show_default=True, choices=('none', 'cores', 'numa'), section='Job shape', help="Pin each process pslaunch starts to its share of its host's cores (a contiguous block each), or to one NUMA node each (read from /sys); local, ssh and agents."),
    Option('host_discovery_script', ('--host-discovery-script',), 'text', metavar='PROGRAM', section='Ending and restarts', help="An elastic job's hosts (-n MIN:MAX, --launcher ssh, instead of -H): a program that prints host:slots lines, run every second; workers join on slots that appear and leave hosts that go."),
    Option('elastic_timeout', ('--elastic-timeout',), 'float', default=60.0, metavar='S', show_default=True, section='Ending and restarts', help='An elastic job (-n MIN:MAX) with fewer than MIN workers waits S seconds for more, then fails naming what it waited for.'),
    Option('stall_warn', ('--stall-warn',), 'float', default=60.0, metavar='S', show_default=True, section='Observability', help="Say in the log when a dist_sync round of a key or a barrier has waited S seconds, naming the key or barrier and the ranks and hosts it waits for (0: never)."),
    Option('stall_timeout', ('--stall-timeout',), 'float', default=0.0, metavar='S', show_default=True, section='Observability', help="End the job when a round, barrier or collective has been stalled S seconds: the root cause says stalled, names the rank it waits for and shows its Python stack; exit code 86 (0: never)."),
    Option('summary_json', ('--summary-json',), 'path', metavar='FILE', dir_okay=False, section='Observability', help="Write the final table (each process's exit, duration, bytes, the root cause) to FILE as JSON."),
    Option('timeline', ('--timeline',), 'path', metavar='FILE', dir_okay=False, section='Observability', help='Write a Chrome / Perfetto trace of the job to FILE (pushes, pulls, waits, merges, updates per key; barriers; registration), clocks aligned across hosts.'),
)
_BY_NAME = {option.name: option for option in OPTIONS}


def defaults() -> dict[str, Any]:
    """Every option's value when it is not given (``COMMAND`` aside), by name."""
    return {option.name: option.empty for option in OPTIONS}


def read_value(name: str, value: Any) -> Any:
    """``value`` for option ``name`` as the command line reads it: ``"2"`` for an ``int`` option is
    2, one text for a repeatable option a tuple of it.

    Raises:
        ConfigError: a value of the wrong kind, naming the option's keyword and the value.
    """
    option = _BY_NAME[name]
    if value is None:
        return option.empty if option.kind in ("flag", "count") or option.multiple else None
    if option.multiple:
        items = (value,) if isinstance(value, (str, bytes)) else tuple(value)
        return tuple(_one(option, item, value) for item in items)
    return _one(option, value, value)


def _one(option: Option, value: Any, given: Any) -> Any:
    def refused(why: str) -> ConfigError:
        return ConfigError(f"launch({option.name}={given!r}): {why}")

    kind = option.kind
    if kind in ("flag", "toggle"):
        if not isinstance(value, bool):
            raise refused(f"{value!r} is not True or False.")
        return value
    if kind == "workers":  # N or MIN:MAX
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise refused(f"{value!r} is not a number of workers: give N or MIN:MAX (2, '2:4').")
        try:
            parse_workers(str(value))
        except ValueError as exc:
            raise refused(f"{str(value)!r} {exc}") from None
        return str(value)
    if kind in ("int", "count"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise refused(f"{value!r} is not a valid integer.")
        try:
            number = int(value)
        except ValueError:
            raise refused(f"{value!r} is not a valid integer.") from None
        if option.minimum is not None and number < option.minimum:
            raise refused(f"{number} is not in the range x>={option.minimum}.")
        return number
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise refused(f"{value!r} is not a valid float.")
        try:
            number = float(value)
        except ValueError:
            raise refused(f"{value!r} is not a valid float.") from None
        if math.isnan(number):
            raise refused(f"{value!r} is not a valid float.")
        return number
    if not isinstance(value, (str, os.PathLike)):
        raise refused(f"{value!r} is not a text.")
    text = os.fspath(value)
    if kind == "choice" and text not in option.choices:
        raise refused(f"{text!r} is not one of {', '.join(repr(c) for c in option.choices)}.")
    return text


def refuse_unused(backend: type[Backend], options: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` for an option given (its value not its default) that ``backend`` has
    no use for, naming the option, the backend and why: one it ``refuses`` by name or by group
    (``ssh``), or one of another backend's own group (``--ray-timeout`` for ``--launcher local``)."""
    for option in OPTIONS:
        if options.get(option.name, option.empty) in (option.empty, None, ()):
            continue
        why = backend.refuses.get(option.name) or backend.refuses.get(option.group or "")
        if why is None and option.group in OWN_GROUPS and option.group != backend.name:
            why = f"it is read by --launcher {option.group} only"
        if why is not None:
            raise ConfigError(f"{option.shown} is not an option of --launcher {backend.name}: {why}")


def parse_workers(text: str) -> tuple[int, int]:
    """``-n``: ``4`` -> (4, 4); ``2:4`` -> (2, 4), an elastic job. Raises ``ValueError`` with what is
    wrong, said of the value (``must be >= 1, got 0``)."""
    low, sep, high = text.strip().partition(":")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError("is not a number of workers: give N or MIN:MAX (-n 4, -n 2:4)") from None
    if first < 1:
        raise ValueError(f"must be >= 1, got {first}")
    if last < first:
        raise ValueError(f"has its minimum {first} above its maximum {last}")
    return first, last


def discover_at_start(script: str, options: Mapping[str, Any], hosts: tuple) -> tuple:
    """``--host-discovery-script``: the hosts it reports once they hold the job's minimum of workers
    (asked every second for ``--elastic-timeout`` seconds). Raises ``ConfigError`` naming what it
    reported, or why it could not be read."""
    if hosts:
        raise ConfigError("--host-discovery-script reports the hosts; it does not combine with -H/--hostfile")
    try:
        low, _ = parse_workers(str(options["num_workers"]))
    except ValueError:
        low = 1  # the -n error is said with the others
    source = DiscoveryScript(script)
    deadline = time.monotonic() + max(0.0, float(options["elastic_timeout"]))
    while True:
        try:
            found = tuple(source.read())
            why = None
        except CapacityError as exc:
            found, why = (), str(exc)
        slots = sum(h.slots or 0 for h in found)
        if slots >= low:
            return found
        if time.monotonic() >= deadline:
            said = why or (f"{slots} slot{'s' if slots != 1 else ''} ("
                           + (", ".join(f"{h.label}:{h.slots}" for h in found) or "no hosts") + ")")
            raise ConfigError(f"{source.describe} reported {said}, fewer than the job's minimum of {low} workers "
                              f"(-n), for {options['elastic_timeout']:g} s (--elastic-timeout)")
        time.sleep(1.0)


def build_config(options: Mapping[str, Any], environ: Mapping[str, str]) -> LaunchConfig:
    """Turn the options' values (by name, as ``defaults`` and the command line give them, with
    ``command``) into a ``LaunchConfig``: the hostfile read, ``--env`` parsed, each backend's options
    in their group. Raises ``ConfigError`` / ``HostfileError`` naming the bad value, or when the
    backend has no use for an option given (``refuse_unused``)."""
    from .backends import default_backend, get_backend

    hosts = tuple(parse_hostfile(options["hostfile"])) if options["hostfile"] else ()
    discovery = options["host_discovery_script"]
    if discovery:
        hosts = discover_at_start(discovery, options, hosts)
    backend = options["backend"] or default_backend(hosts)
    agents = _agent_options(options, environ)
    if agents:
        if options["backend"] not in (None, "agents"):
            raise ConfigError(f"--nnodes starts pslaunch as a per-node agent, which starts this node's processes "
                              f"itself; it does not combine with --launcher {options['backend']}")
        backend = "agents"
    backend_cls = get_backend(backend)  # an unknown name fails here, listing the known ones
    refuse_unused(backend_cls, options)
    env = tuple(
        parse_env_option(text, scope, environ)
        for scope, key in (("all", "env_all"), ("server", "env_server"), ("worker", "env_worker"))
        for text in options[key]
    )
    if options["ssh_port"] is not None and not 1 <= options["ssh_port"] <= 65535:
        raise ConfigError(f"--ssh-port must be in 1..65535, got {options['ssh_port']}")
    if options["identity"] and not os.path.isfile(os.path.expanduser(options["identity"])):
        raise ConfigError(f"-i/--identity: no such key file {options['identity']!r}")
    try:
        min_workers, num_workers = parse_workers(str(options["num_workers"]))
    except ValueError as exc:
        raise ConfigError(f"-n/--num-workers {str(options['num_workers'])!r} {exc}") from None
    metrics_address, metrics_port = ("127.0.0.1", None)
    if options["metrics_port"] is not None:
        metrics_address, metrics_port = parse_metrics_option(options["metrics_port"])
    config = LaunchConfig(
        command=tuple(options["command"]),
        num_workers=num_workers,
        min_workers=min_workers,
        num_servers=num_workers if options["num_servers"] is None else options["num_servers"],
        backend=backend,
        hosts=hosts,
        user_command_for_all_roles=options["command_for_all_roles"],
        python=options["python"],
        # children get PYTHONUNBUFFERED=1 unless the user set it for pslaunch (then their value)
        python_unbuffered=environ.get("PYTHONUNBUFFERED", "1"),
        env=env,
        scheduler_host=options["scheduler_host"],
        scheduler_port=options["scheduler_port"],
        interface=options["interface"],
        link_timeout=options["link_timeout"],
        sync_dst_dir=options["sync_dst_dir"],
        sync_src_dir=os.getcwd(),
        cwd=os.getcwd(),
        log_dir=options["log_dir"],
        ranks=parse_ranks_option(options["ranks"]) if options["ranks"] is not None else None,
        timestamps=options["timestamps"],
        timeout=options["timeout"],
        stop_grace=options["stop_grace"],
        shutdown_grace=options["shutdown_grace"],
        job_id=options["job_id"] or agents.get("job_id") or uuid.uuid4().hex[:12],
        job_key=agents["job_key"] if agents else new_job_key(),
        encrypt=options["encrypt"],
        max_restarts=options["max_restarts"],
        checkpoint_dir=os.path.abspath(os.path.expanduser(options["checkpoint_dir"])) if options["checkpoint_dir"] else None,
        allow_restart_from_scratch=options["allow_restart_from_scratch"],
        restart_scope=options["restart_scope"],
        server_replicas=options["server_replicas"],
        stall_warn=options["stall_warn"],
        stall_timeout=options["stall_timeout"],
        cpu_bind=options["cpu_bind"],
        elastic_timeout=options["elastic_timeout"],
        hostfile=options["hostfile"],
        host_discovery_script=discovery,
        verbose=options["verbose"],
        quiet=options["quiet"],
        dry_run=options["dry_run"],
        dashboard=_dashboard_wanted(options["dashboard"], options["quiet"]),
        metrics_address=metrics_address,
        metrics_port=metrics_port,
        # the log dir keeps the final table as JSON too, unless it goes elsewhere
        summary_json=options["summary_json"] or (os.path.join(options["log_dir"], "summary.json")
                                                 if options["log_dir"] else None),
        timeline=options["timeline"],
        gpus_per_worker=options["gpus_per_worker"],
        ssh=SshOptions(port=options["ssh_port"], user=options["ssh_user"],
                       identity=os.path.expanduser(options["identity"]) if options["identity"] else None,
                       config=options["ssh_config"], known_hosts=options["known_hosts"],
                       host_key_policy=options["host_key_policy"], connect_timeout=options["connect_timeout"]),
        slurm=SlurmOptions(args=options["slurm_args"]),
        sge=SgeOptions(args=options["sge_args"], pe=options["sge_pe"]),
        ray=RayOptions(address=options["ray_address"], strategy=options["ray_strategy"],
                       worker_resources=options["ray_worker_resources"],
                       server_resources=options["ray_server_resources"], timeout=options["ray_timeout"],
                       exclude=tuple(options["ray_exclude"] or ())),
        agents=AgentOptions(nnodes=agents.get("nnodes"), min_nnodes=agents.get("min_nnodes", 0),
                            node_rank=agents.get("node_rank", 0),
                            rdzv_endpoint=agents.get("rdzv_endpoint"),
                            rdzv_timeout=options.get("rdzv_timeout", DEFAULT_RDZV_TIMEOUT)),
    )
    return config


def _agent_options(options: dict, environ: dict[str, str]) -> dict:
    """With ``--nnodes``: the node's rank (``--node-rank``, else ``PSLAUNCH_NODE_RANK``, else
    Kubernetes' ``JOB_COMPLETION_INDEX``), the job key every node holds (``PSLAUNCH_JOB_KEY_FILE``
    or ``PSLAUNCH_JOB_KEY``) and the job id every node derives alike; empty without ``--nnodes``.

    Raises ``ConfigError`` naming the variable or flag at fault."""
    given = options.get("nnodes")
    if given is None:
        for flag in ("node_rank", "rdzv_endpoint"):
            if options.get(flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} is an option of the per-node agents: give --nnodes N too")
        return {}
    try:
        min_nnodes, nnodes = parse_workers(str(given))
    except ValueError as exc:
        raise ConfigError(f"--nnodes {str(given)!r} {str(exc).replace('workers', 'nodes').replace('-n ', '--nnodes ')}") from None
    rank = options.get("node_rank")
    if rank is None:
        for name in (ec.PSLAUNCH_NODE_RANK, ec.JOB_COMPLETION_INDEX):
            text = environ.get(name, "").strip()
            if text:
                if not text.isdigit():
                    raise ConfigError(f"{name}={text!r} is not a node rank (a number 0..{nnodes - 1})")
                rank = int(text)
                break
    if rank is None:
        if nnodes != 1:
            raise ConfigError(f"--nnodes {nnodes}: this node's rank is not given: --node-rank R, or "
                              f"{ec.PSLAUNCH_NODE_RANK}, or Kubernetes' {ec.JOB_COMPLETION_INDEX} (an Indexed Job sets it)")
        rank = 0
    endpoint = options.get("rdzv_endpoint")
    if not endpoint:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the address of node 0 that every node "
                          "reaches (node 0 listens there)")
    host, port = parse_endpoint(endpoint)
    try:
        key = ec.read_job_key(environ)
    except ec.JobKeyError as exc:
        raise ConfigError(str(exc)) from None
    return {"nnodes": nnodes, "min_nnodes": min_nnodes if min_nnodes < nnodes else 0, "node_rank": rank,
            "rdzv_endpoint": endpoint, "job_key": key.hex() if key else "", "job_id": ec.shared_job_id(host, port)}


def _dashboard_wanted(asked: bool | None, quiet: bool) -> bool:
    """The dashboard is drawn only on a terminal (stdout and stderr both), never with --quiet; on a
    terminal it is on unless --no-dashboard."""
    if asked is False or quiet:
        return False
    return all(_isatty(stream) for stream in (sys.stdout, sys.stderr)) and os.environ.get("TERM") != "dumb"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
