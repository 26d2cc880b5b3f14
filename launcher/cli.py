"""The ``pslaunch`` command: parse the command line into a ``LaunchConfig`` and run it.

Kept thin on purpose: click parses, ``launcher.config`` validates, ``launcher.plan`` plans,
a backend from ``launcher.backends`` starts, ``launcher.supervisor`` watches. Every user-facing
error is a ``LaunchError`` (or click's own) and is printed here, once, as one line.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

import click

import pscontract as ec
from pscontract import new_job_key

from .config import (
    DEFAULT_LINK_TIMEOUT,
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_STOP_GRACE,
    LaunchConfig,
    parse_endpoint,
    parse_env_option,
    parse_metrics_option,
    parse_ranks_option,
)
from .errors import ConfigError, LaunchError
from .hostfile import parse_hostfile

__all__ = ["cli", "main", "build_config", "BACKEND_OPTIONS", "HELP_SECTIONS"]

#: Flags that only one backend reads; that backend's ``options`` must name the ones it takes.
BACKEND_OPTIONS = ("slurm_args", "sge_args", "sge_pe", "ray_address", "ray_strategy", "ray_worker_resources",
                   "ray_server_resources", "ray_timeout", "ray_exclude")

_EPILOG = """\b
Examples:
  pslaunch -n 2 -s 1 python train.py --lr "0.1 x"     everything on this machine
  pslaunch -n 4 -s 2 -H hosts train.py                 over ssh, see hosts.example
  pslaunch -n 4 -s 0 train.py                          allreduce: scheduler and workers, no servers
  pslaunch -n 2 --launcher mpi python train.py         one mpirun for every role
  pslaunch -n 8 -s 4 --launcher slurm train.py         one Slurm job step (salloc/sbatch or its own)
  pslaunch -n 8 -s 4 --launcher sge train.py           one SGE parallel-environment job
  pslaunch -n 4 -s 2 --launcher ray train.py           on a Ray cluster (RAY_ADDRESS), one placement group
  pslaunch -n 2 --dry-run -H hosts train.py            print the plan, start nothing
\b
Exit codes: 0 success; the (last) root-cause process's code (128+signal; 1 when it is 2-5); 2 bad input;
3 a host failed the pre-flight check; 4 rsync failed; 5 a process could not be started; 75 a
process ended because of another and none failed on its own; 124 --timeout; 129 / 130 / 143
SIGHUP / SIGINT / SIGTERM; 255 a host was lost. Documentation: docs/launcher.md.
"""


#: ``--help``'s sections, in order, by each option's name; an option in none is listed under "Other".
HELP_SECTIONS = {
    "Job shape": ("num_workers", "num_servers", "backend", "command_for_all_roles", "python", "env_all",
                  "env_server", "env_worker", "gpus_per_worker", "scheduler_host", "scheduler_port", "interface",
                  "job_id"),
    "Hosts and ssh": ("hostfile", "sync_dst_dir", "ssh_port", "ssh_user", "identity", "ssh_config", "known_hosts",
                      "host_key_policy", "connect_timeout", "link_timeout"),
    "Batch systems": ("slurm_args", "sge_args", "sge_pe"),
    "Ray clusters": ("ray_address", "ray_strategy", "ray_worker_resources", "ray_server_resources", "ray_timeout",
                     "ray_exclude"),
    "Nodes without ssh": ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_timeout"),
    "Output": ("log_dir", "ranks", "timestamps", "verbose", "quiet", "dry_run"),
    "Ending and restarts": ("timeout", "stop_grace", "shutdown_grace", "max_restarts", "checkpoint_dir",
                            "allow_restart_from_scratch", "restart_scope"),
    "Security": ("encrypt",),
    "Observability": ("dashboard", "metrics_port", "summary_json", "timeline"),
}


class _SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options in ``HELP_SECTIONS`` instead of one flat list."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {param.name: param.get_help_record(ctx) for param in self.get_params(ctx)
                   if isinstance(param, click.Option)}
        placed = {name for names in HELP_SECTIONS.values() for name in names}
        sections = [*HELP_SECTIONS.items(), ("Other", tuple(n for n in records if n not in placed))]
        for title, names in sections:
            rows = [records[name] for name in names if records.get(name) is not None]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


@click.command(
    cls=_SectionedCommand,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    epilog=_EPILOG,
)
@click.option("-n", "--num-workers", type=int, required=True, help="Number of worker processes.")
@click.option("-s", "--num-servers", type=int, default=None,
              help="Number of servers [default: = workers]; 0: none, the workers sum among themselves "
                   "(kvcore.create('allreduce')).")
@click.option("-H", "--hostfile", type=click.Path(dir_okay=False), default=None,
              help="Hosts to run on: `[user@]host[:sshport] [slots=N]` per line.")
@click.option("--launcher", "backend", default=None, metavar="NAME",
              help="Backend: local, ssh, mpi, slurm, sge or ray [default: ssh with a hostfile, local without].")
@click.option("--command-for-all-roles", is_flag=True,
              help="Run COMMAND as scheduler and servers too (MXNet / ps-lite / BytePS programs) "
                   "instead of the bundled runtime `python -m psnode`.")
@click.option("-x", "--env", "env_all", multiple=True, metavar="NAME[:VALUE]",
              help="Set NAME for every process (NAME=VALUE too, as mpirun's -x); NAME alone forwards "
                   "pslaunch's own value. Repeatable.")
@click.option("--env-server", multiple=True, metavar="NAME[:VALUE]", help="Like --env, for scheduler and servers.")
@click.option("--env-worker", multiple=True, metavar="NAME[:VALUE]", help="Like --env, for workers.")
@click.option("--gpus-per-worker", type=click.IntRange(min=1), default=None, metavar="K",
              help="Give each worker K GPUs of its host: CUDA_VISIBLE_DEVICES from its local rank "
                   "(local rank r gets GPUs r*K .. r*K+K-1) [default: CUDA_VISIBLE_DEVICES untouched].")
@click.option("--scheduler-host", default=None, help="Run the scheduler on this host [default: here].")
@click.option("--scheduler-port", type=int, default=None, help="Scheduler port [default: a free one].")
@click.option("--interface", default=None, metavar="NAME[,NAME...]|NETWORK",
              help="The interface whose address each node advertises, resolved on each host: a name, names "
                   "tried in order (ib0,eth0) or an IPv4 network (10.1.0.0/16) [default: toward the scheduler].")
@click.option("--sync-dst-dir", default=None, metavar="DIR",
              help="rsync the current directory to DIR on every host first; processes start there.")
@click.option("--ssh-port", type=int, default=None, help="ssh port for hosts whose line gives none.")
@click.option("--ssh-user", default=None, help="ssh user for hosts whose line gives none.")
@click.option("-i", "--identity", type=click.Path(dir_okay=False), default=None, help="ssh private key file.")
@click.option("--ssh-config", type=click.Path(dir_okay=False), default=None,
              help="ssh client config [default: ~/.ssh/config].")
@click.option("--known-hosts", type=click.Path(dir_okay=False), default=None,
              help="Where accepted host keys are recorded [default: ~/.ssh/known_hosts].")
@click.option("--host-key-policy", type=click.Choice(["accept-new", "strict", "ignore"]), default="accept-new",
              show_default=True, help="Unknown host keys: record them, refuse them, or neither.")
@click.option("--connect-timeout", type=float, default=10.0, show_default=True,
              help="Seconds for each host's pre-flight ssh check.")
@click.option("--link-timeout", type=float, default=DEFAULT_LINK_TIMEOUT, show_default=True,
              help="Seconds without a word between pslaunch and a remote host after which the host is lost "
                   "and its processes are stopped there (0: never).")
@click.option("--slurm-args", default=None, metavar="ARGS",
              help="Slurm options for the allocation pslaunch asks for, or for its job step inside an "
                   "allocation: partition, account, time, ... (--launcher slurm).")
@click.option("--sge-args", default=None, metavar="ARGS",
              help="qsub options: queue, resources, project, ... (--launcher sge).")
@click.option("--sge-pe", default=None, metavar="NAME",
              help="SGE parallel environment the job asks slots of [default: smp] (--launcher sge).")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="The Ray cluster to run on (--launcher ray) [default: $RAY_ADDRESS, then auto: the cluster this "
                   "machine is a node of].")
@click.option("--ray-strategy", type=click.Choice(["spread", "pack"]), default=None,
              help="How the placement group spreads the processes over the nodes: spread (servers on distinct "
                   "nodes when it can) or pack [default: spread] (--launcher ray).")
@click.option("--ray-worker-resources", default=None, metavar="JSON",
              help="""What each worker asks of Ray, e.g. '{"CPU": 1, "GPU": 1}' [default: {"CPU": 1}] """
                   "(--launcher ray).")
@click.option("--ray-server-resources", default=None, metavar="JSON",
              help="""What each server asks of Ray [default: {"CPU": 1}] (--launcher ray).""")
@click.option("--ray-timeout", default=None, metavar="SECONDS",
              help="Seconds Ray has to place the job's placement group; then the missing resources are named "
                   "[default: 60; without it a group the cluster's own resources can never hold is refused at "
                   "once] (--launcher ray).")
@click.option("--ray-exclude", multiple=True, metavar="PATTERN",
              help="Leave what PATTERN matches (a .gitignore line) out of the working directory Ray uploads to "
                   "every node; repeatable. Past Ray's 512 MiB package limit pslaunch refuses before zipping "
                   "anything, naming the biggest entries (--launcher ray).")
@click.option("--nnodes", type=int, default=None, metavar="N",
              help="Run as one of N per-node agents: the same command on every node, no ssh between them; node 0 "
                   "runs the scheduler and the job's table (-n and -s stay totals, spread over the nodes).")
@click.option("--node-rank", type=int, default=None, metavar="R",
              help="This node's rank, 0..N-1 [default: $PSLAUNCH_NODE_RANK, then Kubernetes' $JOB_COMPLETION_INDEX].")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT",
              help="Node 0's address, which every node reaches: node 0's agent listens at PORT, its scheduler at "
                   "PORT+1 (unless --scheduler-port).")
@click.option("--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT, show_default=True,
              help="Seconds the agents have to find each other; a node missing then is named.")
@click.option("--python", default=sys.executable, show_default="this Python",
              help="Interpreter for a COMMAND starting with python, python3 or a .py file, and for the bundled runtime.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None, help="Keep one log file per process here.")
@click.option("--ranks", default=None, metavar="LIST",
              help="Show only these workers' lines, e.g. 0,3-5 (the scheduler's and servers' lines, the log "
                   "files and the summary keep everything).")
@click.option("--timestamps", is_flag=True, help="Start each line of a process with the time it arrived (HH:MM:SS.mmm).")
@click.option("--timeout", type=float, default=None, help="Stop the job after this many seconds (exit 124).")
@click.option("--stop-grace", type=float, default=DEFAULT_STOP_GRACE, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping processes.")
@click.option("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE, show_default=True,
              help="Seconds a scheduler or server that is not the bundled runtime gets to exit after every "
                   "worker exited 0 (bundled ones are asked to end at once).")
@click.option("--job-id", default=None, help="Job id (PSLAUNCH_JOB_ID) [default: random].")
@click.option("--encrypt", is_flag=True,
              help="Encrypt every connection of the job (CurveZMQ, keys from the job's key); slower, for networks "
                   "others can read.")
@click.option("--dashboard/--no-dashboard", default=None,
              help="A live table of every process (state, rates, heartbeats; the straggler marked) below the "
                   "output [default: on when stdout and stderr are a terminal; never otherwise].")
@click.option("--metrics-port", default=None, metavar="[ADDR:]PORT",
              help="Serve the job's counters as Prometheus text at http://ADDR:PORT/metrics (ADDR 127.0.0.1 "
                   "unless given) while the job runs.")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write the final table (each process's exit, duration, bytes, the root cause) to FILE as JSON.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write a Chrome / Perfetto trace of the job to FILE (pushes, pulls, waits, merges, updates "
                   "per key; barriers; registration), clocks aligned across hosts.")
@click.option("--max-restarts", type=int, default=0, show_default=True, metavar="N",
              help="Restart the job after a failure, N times at most in all (the count is the job's, "
                   "PSLAUNCH_RESTART_COUNT); needs --checkpoint-dir or --allow-restart-from-scratch.")
@click.option("--checkpoint-dir", default=None, metavar="DIR",
              help="Where the servers keep checkpoints (kvcore.elastic.State); every server host must reach it.")
@click.option("--allow-restart-from-scratch", is_flag=True,
              help="Allow --max-restarts without --checkpoint-dir: a restarted job begins from scratch.")
@click.option("--restart-scope", type=click.Choice(["job", "worker"]), default="job", show_default=True,
              help="What a restart starts again: every process, or only a failed worker (dist_async), "
                   "while the others go on.")
@click.option("--dry-run", is_flag=True, help="Print the plan (hosts, argv, environment names) and exit.")
@click.option("-v", "--verbose", count=True, help="More about what pslaunch does; -vv also sets PS_VERBOSE.")
@click.option("-q", "--quiet", is_flag=True, help="Only the root cause of a failure; no output lines, no table.")
@click.version_option(None, "--version", package_name="pslaunch", prog_name="pslaunch", message="%(prog)s %(version)s")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def cli(**options) -> None:
    """Start a parameter-server job: a scheduler, servers and workers running COMMAND (with -s 0 no
    servers: an allreduce job).

    Everything after the options is COMMAND and its arguments, passed on unchanged.
    """
    from .api import plan_job, run
    from .backends import get_backend
    from .plan import format_plan

    environ = dict(os.environ)
    config = build_config(options, environ)
    if not config.quiet:
        for advice in config.advice():
            click.echo(f"pslaunch: warning: {advice}", err=True)
    if config.dry_run:
        resolved, plan = plan_job(config, environ)
        get_backend(config.backend).check_without_starting(resolved, plan)  # what a real run would refuse
        click.echo(format_plan(get_backend(config.backend).dry_run_plan(resolved, plan)))
        for line in get_backend(config.backend).dry_run_notes(resolved):
            click.echo(line)
        return
    code = run(config).exit_code
    # the job has ended and been reported: a Ctrl-C more must not turn the exit code into a signal's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


def build_config(options: dict, environ: dict[str, str]) -> LaunchConfig:
    """Turn click's parsed ``options`` into a ``LaunchConfig`` (hostfile read, --env parsed).

    Raises ``ConfigError`` / ``HostfileError`` naming the bad value.
    """
    from .backends import default_backend, get_backend

    hosts = tuple(parse_hostfile(options["hostfile"])) if options["hostfile"] else ()
    backend = options["backend"] or default_backend(hosts)
    agents = _agent_options(options, environ)
    if agents:
        if options["backend"] not in (None, "agents"):
            raise ConfigError(f"--nnodes starts pslaunch as a per-node agent, which starts this node's processes "
                              f"itself; it does not combine with --launcher {options['backend']}")
        backend = "agents"
    backend_cls = get_backend(backend)  # an unknown name fails here, listing the known ones
    backend_options = tuple((name, options[name]) for name in BACKEND_OPTIONS if options.get(name) not in (None, ()))
    for name, _ in backend_options:
        if name not in backend_cls.options:
            raise ConfigError(f"--{name.replace('_', '-')} is not an option of --launcher {backend}")
    if backend_cls.needs_hostfile and not hosts:
        raise ConfigError(f"--launcher {backend} needs -H/--hostfile naming the hosts")
    env = tuple(
        parse_env_option(text, scope, environ)
        for scope, key in (("all", "env_all"), ("server", "env_server"), ("worker", "env_worker"))
        for text in options[key]
    )
    if options["ssh_port"] is not None and not 1 <= options["ssh_port"] <= 65535:
        raise ConfigError(f"--ssh-port must be in 1..65535, got {options['ssh_port']}")
    if options["identity"] and not os.path.isfile(os.path.expanduser(options["identity"])):
        raise ConfigError(f"-i/--identity: no such key file {options['identity']!r}")
    num_workers = options["num_workers"]
    metrics_address, metrics_port = ("127.0.0.1", None)
    if options["metrics_port"] is not None:
        metrics_address, metrics_port = parse_metrics_option(options["metrics_port"])
    config = LaunchConfig(
        command=tuple(options["command"]),
        num_workers=num_workers,
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
        ssh_port=options["ssh_port"],
        ssh_user=options["ssh_user"],
        identity=os.path.expanduser(options["identity"]) if options["identity"] else None,
        ssh_config=options["ssh_config"],
        known_hosts=options["known_hosts"],
        host_key_policy=options["host_key_policy"],
        connect_timeout=options["connect_timeout"],
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
        backend_options=backend_options,
        nnodes=agents.get("nnodes"),
        node_rank=agents.get("node_rank", 0),
        rdzv_endpoint=agents.get("rdzv_endpoint"),
        rdzv_timeout=options.get("rdzv_timeout", DEFAULT_RDZV_TIMEOUT),
    )
    backend_cls.refuse_unused(config)
    return config


def _agent_options(options: dict, environ: dict[str, str]) -> dict:
    """With ``--nnodes``: the node's rank (``--node-rank``, else ``PSLAUNCH_NODE_RANK``, else
    Kubernetes' ``JOB_COMPLETION_INDEX``), the job key every node holds (``PSLAUNCH_JOB_KEY_FILE``
    or ``PSLAUNCH_JOB_KEY``) and the job id every node derives alike; empty without ``--nnodes``.

    Raises ``ConfigError`` naming the variable or flag at fault."""
    nnodes = options.get("nnodes")
    if nnodes is None:
        for flag in ("node_rank", "rdzv_endpoint"):
            if options.get(flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} is an option of the per-node agents: give --nnodes N too")
        return {}
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
    return {"nnodes": nnodes, "node_rank": rank, "rdzv_endpoint": endpoint, "job_key": key.hex() if key else "",
            "job_id": ec.shared_job_id(host, port)}


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


#: torchrun's flags (by their dashed names), each with what pslaunch says to it: the pslaunch
#: way, or why it is not needed. ``{value}`` is the flag's value when it was given.
TORCHRUN_FLAGS = {
    "--nproc-per-node": "it counts processes per node, and pslaunch's -n counts every worker of the job (spread "
                        "over the hosts): did you mean -n {value}? (a plain torch script needs no servers: "
                        "-n {value} -s 0)",
    "--standalone": "pslaunch needs no rendezvous on one machine: drop --standalone (pslaunch -n N -s 0 train.py runs "
                    "N workers here)",
    "--rdzv-backend": "pslaunch's per-node agents meet at node 0 themselves, with no rendezvous backend: drop "
                      "--rdzv-backend and give every node --nnodes N --node-rank R --rdzv-endpoint NODE0:PORT",
    "--rdzv-id": "the job's id is --job-id in pslaunch (every agent derives the same one from --rdzv-endpoint)",
    "--rdzv-conf": "pslaunch's agents take no rendezvous configuration: --rdzv-timeout S is how long they wait",
    "--master-addr": "pslaunch sets MASTER_ADDR and MASTER_PORT for every worker itself (worker 0's host, a free "
                     "port): drop it (--scheduler-host places the scheduler)",
    "--master-port": "pslaunch sets MASTER_ADDR and MASTER_PORT for every worker itself (worker 0's host, a free "
                     "port): drop it",
    "--tee": "pslaunch shows every process's output, each line prefixed with its process: drop --tee "
             "(--log-dir DIR also keeps a file per process)",
    "--redirects": "pslaunch keeps each process's output apart already: --log-dir DIR writes a file per process",
    "--log-dir": None,  # the same option in pslaunch
    "--no-python": "pslaunch runs COMMAND as given: a .py file or python ... runs under --python, anything else "
                   "as it is: drop --no-python",
    "--run-path": "pslaunch runs a script by its path: give the file (python path/to/train.py) as COMMAND",
    "--module": "pslaunch runs any COMMAND: write python -m MODULE as COMMAND",
    "-m": "pslaunch runs any COMMAND: write python -m MODULE as COMMAND",
    "--start-method": "pslaunch starts every worker as a process of its own (as torchrun's spawn): drop it",
    "--monitor-interval": "pslaunch watches the processes all the time: drop it",
    "--local-ranks-filter": "pslaunch's --ranks LIST shows only these workers' lines (e.g. --ranks 0,3-5)",
    "--role": "pslaunch's roles are the scheduler, the servers and the workers: drop --role",
    "--max-restarts": None,  # the same option in pslaunch
    "--nnodes": None,
    "--node-rank": None,
    "--rdzv-endpoint": None,
}

_TORCHRUN_VALUELESS = {"--standalone", "--no-python", "--run-path", "--module"}


def _flag_of(token: str) -> tuple[str, str | None]:
    """``--nproc_per_node=2`` -> ``("--nproc-per-node", "2")``: the flag by its dashed name, and its
    ``=`` value."""
    name, _, value = token.partition("=")
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name, value if "=" in token else None


def habit_hint(argv: list[str]) -> str | None:
    """What to say to a flag another launcher taught the user (mpirun's ``-np``, torchrun's flags,
    an option spelt with underscores), found among pslaunch's own options (before COMMAND); None when
    there is none. click would read ``-np 4`` as ``-n p`` and answer ``--nproc-per-node`` with
    ``--gpus-per-worker``."""
    options = [param for param in cli.params if isinstance(param, click.Option)]
    takes_value = {name for param in options if not param.is_flag and not param.count for name in param.opts}
    known = {name for param in options for name in param.opts + param.secondary_opts}
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--" or not token.startswith("-") or token == "-":
            return None  # COMMAND begins: its flags are its own
        if token == "-np" or token.startswith("-np="):
            count = token[4:] if "=" in token else (argv[index + 1] if index + 1 < len(argv) else "N")
            return f"-np is mpirun's; pslaunch counts workers with -n: did you mean -n {count}?"
        name, value = _flag_of(token)
        if name not in known and name in TORCHRUN_FLAGS and TORCHRUN_FLAGS[name] is not None:
            if value is None and name not in _TORCHRUN_VALUELESS:
                value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("-") else "N"
            return f"{token.partition('=')[0]} is torchrun's; " + TORCHRUN_FLAGS[name].format(value=value or "N")
        if token.startswith("--") and token.partition("=")[0] not in known and name in known:
            return f"{token.partition('=')[0]} is spelt {name} in pslaunch"
        index += 2 if token in takes_value else 1
    return None


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run ``cli`` and print any error once, as one line."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        hint = habit_hint(args)
        if hint is not None:
            raise click.UsageError(hint)
        cli.main(args=args, prog_name="pslaunch", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:  # click's own errors in pslaunch's one format
        more = " (pslaunch --help lists every option)" if isinstance(exc, click.UsageError) else ""
        click.echo(f"pslaunch: error: {exc.format_message()}{more}", err=True)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo("pslaunch: interrupted", err=True)
        sys.exit(130)
    except LaunchError as exc:
        click.echo(f"pslaunch: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(0)


if __name__ == "__main__":
    main()
