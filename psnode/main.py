"""Running one bundled node from the environment contract: ``python -m psnode scheduler|server``.

``run_node(role)`` reads the environment (docs/env.md), runs the scheduler or a server until the
job ends and returns the exit code: 0 when the job ended in order, 1 when it failed (the error,
naming the node or variable at fault, is printed on stderr: this is the one place a node's failure
is printed), 2 when the environment is malformed or the process already runs a node.

One node per process: ``run_node`` *claims* the process for its role while the node runs
(``claimed_role()`` says which). MXNet's rule (a script started with ``DMLC_ROLE=server`` runs that
node on ``import kvcore``, see ``kvcore._role``) starts a node only in an unclaimed process, so a
server that imports kvcore while it runs (to unpickle an optimizer) does not start a second one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

from .env import NodeEnv, read_env
from .errors import EnvError, PSNodeError

__all__ = ["run_node", "claimed_role", "claim_process", "main"]

_claim_lock = threading.Lock()
_claimed: str | None = None


def claimed_role() -> str | None:
    """The role of the node this process runs (``scheduler`` or ``server``), or None."""
    return _claimed


@contextlib.contextmanager
def claim_process(role: str) -> Iterator[None]:
    """Claim this process for a ``role`` node while the block runs.

    Raises:
        PSNodeError: the process already runs a node (the message names its role).
    """
    global _claimed
    with _claim_lock:
        if _claimed is not None:
            raise PSNodeError(f"this process already runs the {_claimed} node; a process runs one node")
        _claimed = role
    try:
        yield
    finally:
        with _claim_lock:
            _claimed = None


def run_node(role: str) -> int:
    """Run the ``role`` node of the job the environment describes; return the exit code."""
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
    try:
        with claim_process(role):
            return _serve(role, env)
    except PSNodeError as exc:
        print(f"psnode {role} (pid {os.getpid()}): error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


def _serve(role: str, env: NodeEnv) -> int:
    if role == "scheduler":
        from .scheduler import Scheduler

        return Scheduler(env).run()
    from .server import ServerNode

    node = ServerNode(env)
    try:
        return node.run()
    finally:
        node.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m psnode scheduler|server``: run a bundled node; return the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("scheduler", "server"):
        print("usage: python -m psnode scheduler|server  (the job is described by DMLC_* variables, see docs/env.md)", file=sys.stderr)
        return 2
    return run_node(args[0])
