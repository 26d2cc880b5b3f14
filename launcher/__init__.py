"""The pslaunch launcher: the command, and how a job's processes are planned, started, watched and stopped.

What runs where:

* in pslaunch, on the machine where you type ``pslaunch``:

  - the face: ``cli`` (the ``pslaunch`` command), ``api`` (``launch()`` from Python), ``options``
    (every option once, for both), ``config`` (``LaunchConfig``, with a typed group of options per
    backend) and ``errors``;
  - ``planning/``: which process runs where, with which argv and environment;
  - ``backends/``: how the processes of a plan are started and stopped somewhere, one per
    ``--launcher`` name (a new backend is a module there, its options, and a line in its table);
  - ``observe/``: what you see of the job: its output, the live table, metrics, the timeline;
  - ``supervision/``: watching the processes to the end, the root cause, restarts, the result;

* on the nodes, beside each process: ``on_node/``: the guard, the rank shim, the SGE job, the Ray
  actor and the watchdog, standard library only.

The names of docs/env.md are ``pscontract``'s. Importing this package loads nothing but itself: the
public names below are imported when first used.
"""

import importlib
from typing import Any

#: Where each public name lives; imported when first asked for (PEP 562), so that what runs on the
#: nodes (``launcher.on_node``), which imports this package first, loads none of the rest.
_FACE = {
    "launch": "api", "run": "api", "RunResult": "supervision.result", "ProcessOutcome": "supervision.result",
    "RootCause": "supervision.result", "EnvVar": "config", "LaunchConfig": "config", "parse_env_option": "config",
    "resolve": "planning.network", "Host": "config", "parse_hostfile": "planning.hostfile",
    "parse_hostfile_text": "planning.hostfile", "Plan": "planning.plan", "ProcessSpec": "planning.plan",
    "make_plan": "planning.plan", "format_plan": "planning.plan", "LaunchError": "errors", "ConfigError": "errors",
    "HostfileError": "errors", "PlacementError": "errors", "UnknownBackendError": "errors", "PreflightError": "errors",
    "SyncError": "errors", "SpawnError": "errors", "JobFailed": "errors",
}


def __getattr__(name: str) -> Any:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module 'launcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


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
