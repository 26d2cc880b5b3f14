"""Running one bundled node from the environment contract: ``python -m psnode scheduler|server``.

``run_node(role)`` reads the environment (docs/env.md), runs the scheduler or a server until the
job ends and returns the exit code: 0 when the job ended in order, 1 when it failed (the error,
naming the node or variable at fault, is printed on stderr), 2 when the environment is malformed.
"""

from __future__ import annotations

import os
import sys

from .env import read_env
from .errors import EnvError, PSNodeError

__all__ = ["run_node", "node_running", "main"]

_running = False


def node_running() -> bool:
    """True inside a process that is running a scheduler or server node."""
    return _running


def run_node(role: str) -> int:
    """Run the ``role`` node of the job the environment describes; return the exit code."""
    global _running
    if role not in ("scheduler", "server"):
        print(f"psnode: the role must be scheduler or server, got {role!r}", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    environ["DMLC_ROLE"] = role
    try:
        env = read_env(environ, default_role=None)
    except EnvError as exc:
        print(f"psnode {role}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    _running = True
    try:
        if role == "scheduler":
            from .scheduler import run_scheduler

            return run_scheduler(env)
        from .server import run_server

        return run_server(env)
    except PSNodeError as exc:
        print(f"psnode {role} (pid {os.getpid()}): error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        _running = False


def main(argv: list[str] | None = None) -> int:
    """``python -m psnode scheduler|server``: run a bundled node; return the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("scheduler", "server"):
        print("usage: python -m psnode scheduler|server  (the job is described by DMLC_* variables, see docs/env.md)", file=sys.stderr)
        return 2
    return run_node(args[0])
