"""The ``pslaunch`` command: parse the command line into a ``LaunchConfig`` and run it.

Kept thin on purpose: click parses, ``launcher.config`` validates, ``launcher.planning.plan`` plans,
a backend from ``launcher.backends`` starts, ``launcher.supervision.supervisor`` watches. Every user-facing
error is a ``LaunchError`` (or click's own) and is printed here, once, as one line.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from .errors import LaunchError
from .options import OPTIONS, SECTIONS, Option, build_config

__all__ = ["cli", "main", "build_config", "HELP_SECTIONS"]

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


#: ``--help``'s sections, in order, by each option's name (``Option.section``); ``--version`` is under "Other".
HELP_SECTIONS = {section: tuple(o.name for o in OPTIONS if o.section == section) for section in SECTIONS}


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


def _click_option(option: Option) -> click.Option:
    """``option`` as click declares it."""
    kind = option.kind
    kwargs: dict = {"help": option.help, "metavar": option.metavar, "required": option.required,
                    "show_default": option.show_default or None, "multiple": option.multiple}
    names = [option.name, *option.flags]  # the name first: ``--launcher`` fills ``backend``
    if kind == "flag":
        return click.Option(names, is_flag=True, help=option.help)
    if kind == "toggle":
        return click.Option([option.name, f"{option.flags[0]}/{option.off[0]}"], default=None, help=option.help)
    if kind == "count":
        return click.Option(names, count=True, help=option.help)
    types = {"int": click.INT if option.minimum is None else click.IntRange(min=option.minimum), "float": click.FLOAT,
             "text": click.STRING, "workers": click.STRING, "choice": click.Choice(option.choices),
             "path": click.Path(dir_okay=option.dir_okay, file_okay=option.file_okay)}
    if option.multiple:
        kwargs["default"] = ()
    elif option.default is not None:  # an explicit None would count as given for ``required`` (click 8.3)
        kwargs["default"] = option.default
    return click.Option(names, type=types[kind], **kwargs)


@click.command(
    cls=_SectionedCommand,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    epilog=_EPILOG,
    params=[_click_option(option) for option in OPTIONS],
)
@click.version_option(None, "--version", package_name="pslaunch", prog_name="pslaunch", message="%(prog)s %(version)s")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def cli(**options) -> None:
    """Start a parameter-server job: a scheduler, servers and workers running COMMAND (with -s 0 no
    servers: an allreduce job).

    Everything after the options is COMMAND and its arguments, passed on unchanged.
    """
    from .api import plan_job, run
    from .backends import get_backend
    from .planning.plan import format_plan

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
