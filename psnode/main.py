"""Running one bundled node from the environment contract: ``python -m psnode scheduler|server``.

``run_node(role)`` reads the environment (docs/env.md), runs the scheduler or a server until the
job ends and returns the exit code: 0 when the job ended in order, 1 when it failed (the error,
naming the node or variable at fault, is printed on stderr), 2 when the environment is malformed,
``EXIT_PEER_FAILED`` (75) when another node failed or the job was torn down (one line says which).

Signals: SIGTERM means the job is being torn down (exit 75); SIGUSR1 means the job is over (every
worker exited 0; exit 0): pslaunch sends it so that a job whose workers never used the runtime
ends at once. Under pslaunch the node says it handles them with a marker line on stderr.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .env import EXIT_PEER_FAILED, MARKER_READY, read_env
from .errors import EnvError, PSNodeError

__all__ = ["run_node", "node_running", "main"]

_running = False


class _Ended(BaseException):
    """Raised by the signal handlers; a BaseException so that no ``except Exception`` keeps the node."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_armed = False  # the node exists: a signal unwinds it (see _arm)
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


def _arm() -> None:
    """From here on a signal raises ``_Ended`` in the node's loop, which closes it on the way out."""
    global _armed
    _armed = True


def node_running() -> bool:
    """True inside a process that is running a scheduler or server node."""
    return _running


def run_node(role: str) -> int:
    """Run the ``role`` node of the job the environment describes; return the exit code."""
    global _running, _armed, _role
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
    _role = role
    previous = _install_handlers()
    try:
        if previous and env.supervised:
            print(MARKER_READY, file=sys.stderr, flush=True)
        from . import zmq_transport  # noqa: F401  the default transport, imported before _arm
        if role == "scheduler":
            from .scheduler import run_scheduler as run
        else:
            from .server import run_server as run
        _arm()
        return run(env)
    except PSNodeError as exc:
        print(f"psnode {role} (pid {os.getpid()}): error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except _Ended as end:
        return 0 if end.signum == signal.SIGUSR1 else _stopped_line(role, end.signum)
    finally:
        _running = _armed = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _install_handlers() -> dict:
    """SIGTERM and SIGUSR1 end the node (see the module docstring); returns the handlers replaced,
    empty off the main thread, where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}


def main(argv: list[str] | None = None) -> int:
    """``python -m psnode scheduler|server``: run a bundled node; return the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("scheduler", "server"):
        print("usage: python -m psnode scheduler|server  (the job is described by DMLC_* variables, see docs/env.md)", file=sys.stderr)
        return 2
    return run_node(args[0])
