"""pslaunch from Python: ``launch(...)`` runs a job as the command line does and returns a
``RunResult`` instead of printing one.

    from launcher import launch

    result = launch(["python", "train.py"], num_workers=2, num_servers=1)
    if not result.ok:
        print(result.root_cause.process, result.root_cause.reason, result.root_cause.last_lines)

Its keywords are the command's options by their long names (``num_workers``, ``hostfile``,
``max_restarts``, ``log_dir``, ...; ``launcher`` for ``--launcher``, ``env`` for ``--env``). An error
before anything starts (a bad option, a hostfile line, an unreachable host) raises the
``LauncherError`` subclass the command line reports (a value of the wrong kind, ``timeout="abc"``,
a ``ConfigError`` naming it); a job that runs and fails returns a result with ``ok`` False.
``dry_run=True`` starts nothing: the result's ``plan`` is what ``--dry-run`` prints. Nothing is
printed unless ``quiet=False`` (then as the command prints).
``run(config)`` is the same for a ``LaunchConfig`` (what the command line calls).
"""

from __future__ import annotations

import os
import sys
from typing import IO, TYPE_CHECKING, Any, Mapping, Sequence

from .config import LaunchConfig
from .supervision.result import ProcessOutcome, RootCause, RunResult, result_of

if TYPE_CHECKING:
    from .planning.plan import Plan

__all__ = ["launch", "run", "plan_job", "RunResult", "ProcessOutcome", "RootCause", "result_of"]


def plan_job(config: LaunchConfig, environ: Mapping[str, str]) -> tuple[LaunchConfig, "Plan"]:
    """What every launch does before anything starts, ``--dry-run`` included: its backend's
    ``planned`` (refuse the options it has no use for, resolve, configure, plan). Raises ``LaunchError``."""
    from .backends import get_backend

    return get_backend(config.backend).planned(config, environ)


def run(config: LaunchConfig, out: IO[str] | None = None, err: IO[str] | None = None) -> RunResult:
    """Plan, start and supervise the job ``config`` describes (resolved here); its ``RunResult``.

    ``out``/``err``: where the processes' lines and pslaunch's own go (default: this process's
    stdout and stderr). Raises ``LaunchError`` when the job cannot start.
    """
    from .backends import get_backend
    from .errors import LaunchError
    from .observe.observer import JobObserver
    from .observe.output import Printer
    from .supervision.supervisor import Supervisor

    config, plan = plan_job(config, dict(os.environ))
    printer = Printer(out=out, err=err, quiet=config.quiet, log_dir=config.log_dir, ranks=config.ranks,
                      timestamps=config.timestamps)
    if config.agents.nnodes is not None and config.agents.node_rank > 0:  # an agent: node 0 supervises the job
        from .supervision.agent import run_agent

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

    Raises ``TypeError`` for a keyword the command does not have (naming the nearest one), and the
    ``LauncherError`` subclasses for what pslaunch refuses before starting (``ConfigError`` for a
    value of the wrong kind too, ``HostfileError``, ``PreflightError``, ...).
    """
    import shlex

    from .options import build_config, defaults, read_value

    known = defaults()
    unknown = sorted(name for name in options if name not in known or name == "backend")
    if unknown:
        raise TypeError(_no_such_option(unknown, [n for n in known if n != "backend"]))
    given = dict(known)
    given.update({name: read_value(name, value)
                  for name, value in {**options, "num_workers": num_workers, "num_servers": num_servers}.items()})
    given.update(quiet=quiet, dashboard=options.get("dashboard", False),
                 command=tuple(shlex.split(command) if isinstance(command, str) else command))
    given["backend"] = launcher
    if env is not None:
        texts = [f"{k}={v}" for k, v in env.items()] if isinstance(env, Mapping) else list(env)
        given["env_all"] = tuple(given.get("env_all") or ()) + tuple(texts)
    config = build_config(given, dict(os.environ))
    if config.dry_run:
        return _dry_run(config, quiet)
    if quiet:  # nothing on this process's streams; --log-dir keeps its files
        with open(os.devnull, "w") as sink:
            return run(config, out=sink, err=sink)
    return run(config, out=sys.stdout, err=sys.stderr)


def _no_such_option(unknown: list[str], known: list[str]) -> str:
    """``launch()``'s refusal of keywords it does not have, with the nearest option named."""
    import difflib

    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known + ["launcher", "env"], n=1, cutoff=0.6)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return (f"launch() has no option {', '.join(hints)}; it takes the command's options by their long names: "
            f"{', '.join(sorted(known + ['launcher', 'env']))}")


def _dry_run(config: LaunchConfig, quiet: bool) -> RunResult:
    """``dry_run=True``: the checks and the plan a real run makes, nothing started; the plan's text is
    the result's ``plan`` (and printed unless ``quiet``)."""
    from .backends import get_backend
    from .planning.plan import format_plan

    resolved, plan = plan_job(config, dict(os.environ))
    backend = get_backend(config.backend)
    backend.check_without_starting(resolved, plan)
    text = "\n".join([format_plan(backend.dry_run_plan(resolved, plan)), *backend.dry_run_notes(resolved)])
    if not quiet:
        print(text)
    return RunResult(0, None, (), (), plan=text)
