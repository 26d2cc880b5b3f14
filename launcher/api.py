"""pslaunch from Python: ``launch(...)`` runs a job as the command line does and returns a
``RunResult`` instead of printing one.

    from launcher import launch

    result = launch(["python", "train.py"], num_workers=2, num_servers=1)
    if not result.ok:
        print(result.root_cause.process, result.root_cause.reason, result.root_cause.last_lines)

Its keywords are the command's options by their long names (``num_workers``, ``hostfile``,
``max_restarts``, ``log_dir``, ...; ``launcher`` for ``--launcher``, ``env`` for ``--env``). An error
before anything starts (a bad option, a hostfile line, an unreachable host) raises the
``LauncherError`` subclass the command line reports; a job that runs and fails returns a result
with ``ok`` False. Nothing is printed unless ``quiet=False`` (then as the command prints).
``run(config)`` is the same for a ``LaunchConfig`` (what the command line calls).
"""

from __future__ import annotations

import os
import sys
from typing import IO, TYPE_CHECKING, Any, Mapping, Sequence

from .config import LaunchConfig
from .result import ProcessOutcome, RootCause, RunResult, result_of

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["launch", "run", "plan_job", "RunResult", "ProcessOutcome", "RootCause", "result_of"]


def plan_job(config: LaunchConfig, environ: Mapping[str, str]) -> tuple[LaunchConfig, "Plan"]:
    """What every launch does before anything starts, ``--dry-run`` included: refuse the options its
    backend has no use for (a ``LaunchConfig`` made in Python too), resolve the addresses and ports,
    let the backend fill in what it knows, and plan. Raises ``LaunchError``."""
    from .backends import get_backend
    from .network import resolve
    from .plan import make_plan

    backend = get_backend(config.backend)
    backend.refuse_unused(config)
    config = backend.configure(config if backend.resolves_itself else resolve(config), environ)
    return config, make_plan(config)


def run(config: LaunchConfig, out: IO[str] | None = None, err: IO[str] | None = None) -> RunResult:
    """Plan, start and supervise the job ``config`` describes (resolved here); its ``RunResult``.

    ``out``/``err``: where the processes' lines and pslaunch's own go (default: this process's
    stdout and stderr). Raises ``LaunchError`` when the job cannot start.
    """
    from .backends import get_backend
    from .errors import LaunchError
    from .observe import JobObserver
    from .output import Printer
    from .supervisor import Supervisor

    config, plan = plan_job(config, dict(os.environ))
    printer = Printer(out=out, err=err, quiet=config.quiet, log_dir=config.log_dir, ranks=config.ranks,
                      timestamps=config.timestamps)
    if config.nnodes is not None and config.node_rank > 0:  # an agent: node 0 supervises the job
        from .agents.agent import run_agent

        try:
            return run_agent(config, plan, printer)
        finally:
            printer.close()
    observer = None
    try:
        observer = JobObserver.start(config, plan, printer)  # None when nothing is observed
        backend = get_backend(config.backend)(config, printer)
        if config.verbose:
            printer.note(f"job {plan.job_id}: {len(plan.processes)} processes via {config.backend}")
        supervisor = Supervisor(config, backend, printer, observer)
        supervisor.run(plan)
        return supervisor.result()
    except LaunchError as exc:
        if observer is not None:
            observer.launch_failed(exc)
        raise
    finally:
        if observer is not None:
            observer.close()
        printer.close()


def launch(command: Sequence[str] | str, *, num_workers: int = 2, num_servers: int | None = None,
           launcher: str | None = None, env: Mapping[str, str] | Sequence[str] | None = None,
           quiet: bool = True, **options: Any) -> RunResult:
    """Run ``command`` (argv, or one string split as a shell would) as a pslaunch job and return its
    ``RunResult`` (see the module docstring). ``env``: ``{NAME: VALUE}`` or ``--env`` texts
    (``NAME``, ``NAME:VALUE``, ``NAME=VALUE``) for every process; ``options``: any other option
    of the command by its long name with ``_`` for ``-`` (``hostfile="hosts"``, ``max_restarts=2``,
    ``env_worker=["A:1"]``).

    Raises ``TypeError`` for a keyword the command does not have, and the ``LauncherError``
    subclasses for what pslaunch refuses before starting (``ConfigError``, ``HostfileError``,
    ``PreflightError``, ...).
    """
    import shlex

    from .cli import build_config, cli

    # every option's value as the command line leaves it when not given (click fills them in)
    defaults = {name: value for name, value in cli.make_context("pslaunch", ["-n", "1", "true"]).params.items()
                if name != "command"}
    renamed = {"launcher": "backend"}
    unknown = sorted(name for name in options if name not in defaults or name in ("backend", "dry_run"))
    if unknown:
        raise TypeError(f"launch() has no option {', '.join(unknown)}; it takes the command's options: "
                        f"{', '.join(sorted(n for n in defaults if n not in ('backend', 'dry_run')))}")
    given = dict(defaults)
    given.update(options)
    for name, value in list(given.items()):  # click's multiple options default to tuples
        if isinstance(value, list):
            given[name] = tuple(value)
    given.update(num_workers=num_workers, num_servers=num_servers, quiet=quiet, dry_run=False,
                 dashboard=options.get("dashboard", False), command=tuple(shlex.split(command) if isinstance(
                     command, str) else command))
    given[renamed["launcher"]] = launcher
    if env is not None:
        texts = [f"{k}={v}" for k, v in env.items()] if isinstance(env, Mapping) else list(env)
        given["env_all"] = tuple(given.get("env_all") or ()) + tuple(texts)
    config = build_config(given, dict(os.environ))
    if quiet:  # nothing on this process's streams; --log-dir keeps its files
        with open(os.devnull, "w") as sink:
            return run(config, out=sink, err=sink)
    return run(config, out=sys.stdout, err=sys.stderr)
