"""Running one bundled node from the environment contract: ``python -m psnode scheduler|server``.

``run_node(role)`` reads the environment (docs/env.md), runs the scheduler or a server until the
job ends and returns the exit code: 0 when the job ended in order, 1 when it failed (the error,
naming the node or variable at fault, is printed on stderr: this is the one place a node's failure
is printed), 2 when the environment is malformed or the process already runs a node,
``EXIT_PEER_FAILED`` (75) when another node failed or the job was torn down (one line says which).

Signals: SIGTERM means the job is being torn down (exit 75); SIGUSR1 means the job is over (every
worker exited 0; exit 0): pslaunch sends it so that a job whose workers never used the runtime
ends at once. Under pslaunch the node says it handles them with a marker line on stderr.

One node per process: ``run_node`` *claims* the process for its role while the node runs
(``claimed_role()`` says which). MXNet's rule (a script started with ``DMLC_ROLE=server`` runs that
node on ``import kvcore``, see ``kvcore._role``) starts a node only in an unclaimed process, so a
server that imports kvcore while it runs (to unpickle an optimizer) does not start a second one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

from psnode.env import EXIT_PEER_FAILED, MARKER_READY, NodeEnv, read_env
from psnode.errors import EnvError, PeerDiedError, PSNodeError
from psnode.transport.security import take_job_key

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


class _Ended(BaseException):
    """Raised by the signal handlers; a BaseException so that no ``except Exception`` keeps the node."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_armed = False  # the node exists: a signal unwinds it
_role = ""


def _on_signal(signum: int, frame) -> None:  # noqa: ARG001
    if _armed:
        raise _Ended(signum)
    # Still importing: nothing to close yet, and an exception raised inside an import (numpy's,
    # say) would come out as an ImportError. End right here.
    code = 0 if signum == signal.SIGUSR1 else _stopped_line(_role, signum)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stopped_line(role: str, signum: int) -> int:
    print(f"psnode {role} (pid {os.getpid()}): stopped by {signal.Signals(signum).name}: "
          "the job is being torn down", file=sys.stderr, flush=True)
    return EXIT_PEER_FAILED


def _install_handlers() -> dict:
    """SIGTERM and SIGUSR1 end the node (see the module docstring); returns the handlers replaced,
    empty off the main thread, where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}


def run_node(role: str) -> int:
    """Run the ``role`` node of the job the environment describes; return the exit code."""
    global _armed, _role
    if role not in ("scheduler", "server"):
        print(f"psnode: the role must be scheduler or server, got {role!r}", file=sys.stderr)
        return 2
    try:
        take_job_key()  # out of the environment before anything else runs; the node keeps it
        environ = dict(os.environ)
        environ["DMLC_ROLE"] = role
        env = read_env(environ, default_role=None)
    except EnvError as exc:
        print(f"psnode {role}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    _role = role
    previous = _install_handlers()
    try:
        with claim_process(role):
            if previous and env.supervised:
                sys.stderr.write(MARKER_READY + "\n")  # one write: a marker cut in two is no marker
                sys.stderr.flush()
            node = _build(role, env)
            _armed = True
            try:
                return node.run()
            finally:
                node.close()
    except PeerDiedError as exc:
        print(f"psnode {role} (pid {os.getpid()}): ended because a peer failed: {exc}", file=sys.stderr, flush=True)
        return EXIT_PEER_FAILED
    except EnvError as exc:  # e.g. no job key on a network address: a configuration to fix, not a failure
        print(f"psnode {role} (pid {os.getpid()}): error: {exc}", file=sys.stderr, flush=True)
        return 2
    except PSNodeError as exc:
        print(f"psnode {role} (pid {os.getpid()}): error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except _Ended as end:
        return 0 if end.signum == signal.SIGUSR1 else _stopped_line(role, end.signum)
    finally:
        _armed = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous:
            # the node has ended: a late "the job is over" (pslaunch's SIGUSR1, sent once every worker
            # exited 0) must not kill the process while it exits
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _build(role: str, env: NodeEnv):
    """The scheduler or server node of ``env``, bound and ready to ``run``."""
    if role == "scheduler":
        from psnode.scheduler.node import Scheduler

        return Scheduler(env)
    from psnode.server.node import ServerNode

    return ServerNode(env)


def main(argv: list[str] | None = None) -> int:
    """``python -m psnode scheduler|server``: run a bundled node; return the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("scheduler", "server"):
        print("usage: python -m psnode scheduler|server  (the job is described by DMLC_* variables, see docs/env.md)", file=sys.stderr)
        return 2
    return run_node(args[0])
