"""The pslaunch launcher: the CLI and how processes are placed, started, watched and stopped.

Public face: ``launch`` (a job from Python, returning a ``RunResult``), the configuration, the
planning function, the hostfile parser, the backend registry and the errors. ``launcher.cli``
holds the ``pslaunch`` command; the names of docs/env.md are ``pscontract``'s. Importing this package loads neither paramiko nor rich nor click.
"""

from .api import ProcessOutcome, RootCause, RunResult, launch, run
from .config import EnvVar, LaunchConfig, parse_env_option
from .errors import (
    ConfigError,
    HostfileError,
    JobFailed,
    LaunchError,
    PlacementError,
    PreflightError,
    SpawnError,
    SyncError,
    UnknownBackendError,
)
from .hostfile import Host, parse_hostfile, parse_hostfile_text
from .network import resolve
from .plan import Plan, ProcessSpec, format_plan, make_plan

__all__ = [
    "launch",
    "run",
    "RunResult",
    "ProcessOutcome",
    "RootCause",
    "EnvVar",
    "LaunchConfig",
    "parse_env_option",
    "resolve",
    "Host",
    "parse_hostfile",
    "parse_hostfile_text",
    "Plan",
    "ProcessSpec",
    "make_plan",
    "format_plan",
    "LaunchError",
    "ConfigError",
    "HostfileError",
    "PlacementError",
    "UnknownBackendError",
    "PreflightError",
    "SyncError",
    "SpawnError",
    "JobFailed",
]
