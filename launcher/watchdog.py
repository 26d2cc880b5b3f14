"""A tiny process that kills the job's process groups when pslaunch dies.

pslaunch starts it (``python -m launcher.watchdog GRACE``) in its own session with a pipe on its
stdin and writes ``add PGID`` / ``del PGID`` lines. When the pipe reaches EOF — pslaunch exited,
also by SIGKILL, which no signal handler can catch — the watchdog sends SIGTERM to every group
still registered (and SIGCONT, for groups that are stopped), waits up to GRACE seconds, sends
SIGKILL to the rest and exits.

Only the standard library: it must start fast and must not import the rest of the launcher.
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["main"]


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_all(groups: set[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str] | None = None) -> int:
    """Run the watchdog: read commands from stdin until EOF, then clean up. Returns 0."""
    args = sys.argv[1:] if argv is None else argv
    grace = float(args[0]) if args else 5.0
    # The terminal's Ctrl-C reaches pslaunch, which stops the job itself; the watchdog must stay
    # alive until pslaunch has gone, so it ignores the signals meant for the foreground group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups: set[int] = set()
    for raw in sys.stdin.buffer:
        verb, _, arg = raw.decode("ascii", "replace").strip().partition(" ")
        if verb == "add" and arg.isdigit():
            groups.add(int(arg))
        elif verb == "del" and arg.isdigit():
            groups.discard(int(arg))
    groups = {g for g in groups if _alive(g)}
    if groups:
        _signal_all(groups, signal.SIGTERM)
        _signal_all(groups, signal.SIGCONT)  # a stopped group gets the SIGTERM only once continued
        deadline = time.monotonic() + grace
        while groups and time.monotonic() < deadline:
            time.sleep(0.05)
            groups = {g for g in groups if _alive(g)}
        _signal_all(groups, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
