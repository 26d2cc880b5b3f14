"""A worker process's end is its worker node's: a clean close at exit, a crash reported to the job.

``watch(node)`` (called once, for the process's one worker node, by ``kvcore``): the node closes at
exit, and an uncaught exception prints its traceback first (under pslaunch followed by the FAILED
marker, and a short wait until pslaunch has read it), then tells the scheduler, so every other node
stops naming it. An uncaught error that is another node's failure ends the process with
``EXIT_PEER_FAILED`` and one line instead: this worker did nothing wrong.
"""

from __future__ import annotations

import array
import atexit
import faulthandler
import fcntl
import os
import stat
import sys
import termios
import time
from typing import Any

from pscontract import stack_signal
from psnode.env import EXIT_PEER_FAILED, MARKER_FAILED
from psnode.errors import PeerDiedError

__all__ = ["watch"]


def _wait_until_read(stream: Any, limit: float) -> None:
    """Wait (at most ``limit`` seconds) until the pipe behind ``stream`` is empty: pslaunch has read
    what this process wrote, so the other nodes' reaction cannot be shown before it."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        pending = array.array("i", [0])
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            fcntl.ioctl(fd, termios.FIONREAD, pending)
            if pending[0] == 0:
                return
            time.sleep(0.005)
    except (OSError, ValueError, AttributeError):
        return  # not a pipe we can ask (Linux answers for the writing end too): go on


def _peer_failure(error: BaseException | None) -> PeerDiedError | None:
    """The ``PeerDiedError`` behind ``error`` (kvcore wraps it as the cause), if any."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, PeerDiedError):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def watch(node: Any) -> None:
    """Make this process's end ``node``'s (see the module docstring), and let pslaunch ask for its stack
    (``pscontract.stack_signal``: every thread's, written to stderr by ``faulthandler``)."""
    atexit.register(node.close)
    try:
        faulthandler.register(stack_signal(), file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no such signal here, or stderr is no file
        pass
    previous = sys.excepthook

    def report_crash(kind: type, value: BaseException, tb: Any) -> None:
        peer = _peer_failure(value)
        if peer is not None:
            _exit_for_peer(node, peer)
        # the traceback goes out before the other nodes hear of the failure and end, so that it is
        # the first error of the job on the screen and in pslaunch's report
        previous(kind, value, tb)
        if node.env.supervised:
            sys.stderr.write(MARKER_FAILED + "\n")  # one write: a marker cut in two is no marker
            sys.stderr.flush()
            _wait_until_read(sys.stderr, 0.5)
        node.abort(f"{kind.__name__}: {value}")

    sys.excepthook = report_crash


def _exit_for_peer(node: Any, error: PeerDiedError) -> None:
    """End the process with ``EXIT_PEER_FAILED`` and one line naming the failed peer instead of a
    traceback: this worker did nothing wrong. Exit handlers still run."""
    print(f"psnode worker {node.rank} (pid {os.getpid()}): ended because a peer failed: {error}",
          file=sys.stderr, flush=True)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_PEER_FAILED)  # an excepthook cannot choose the exit code otherwise
