"""A tiny process that kills the job's process groups when pslaunch dies.

pslaunch starts it (``python -m launcher.on_node.watchdog GRACE``) in its own session with a pipe on its
stdin and writes ``add PGID [STARTED]`` / ``del PGID`` lines (``STARTED``: when the group's leader
started, so that an id a stranger took since is left alone, ``process_groups.Group``). When the pipe reaches EOF — pslaunch exited,
also by SIGKILL, which no signal handler can catch — the watchdog sends SIGTERM to every group
still registered (and SIGCONT, for groups that are stopped), waits up to GRACE seconds, sends
SIGKILL to the rest, then runs each command registered with a ``run ["argv", ...]`` line (a JSON
list: a batch scheduler's ``scancel JOB`` / ``qdel JOB``, for a job that would otherwise outlive
pslaunch) and exits. ``clear`` forgets the commands: pslaunch has cleaned up itself.

Only the standard library (``launcher.on_node``): it must start fast and must not import the rest of
the launcher. It stops the groups as everything else does (``process_groups.stop_groups``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from .process_groups import Group, stop_groups

__all__ = ["main"]

#: Seconds each cleanup command may take.
_COMMAND_TIMEOUT = 30


def main(argv: list[str] | None = None) -> int:
    """Run the watchdog: read commands from stdin until EOF, then clean up. Returns 0."""
    args = sys.argv[1:] if argv is None else argv
    grace = float(args[0]) if args else 5.0
    # The terminal's Ctrl-C reaches pslaunch, which stops the job itself; the watchdog must stay
    # alive until pslaunch has gone, so it ignores the signals meant for the foreground group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups: dict[int, Group] = {}
    commands: list[list[str]] = []
    for raw in sys.stdin.buffer:
        verb, _, arg = raw.decode("utf-8", "replace").strip().partition(" ")
        words = arg.split()
        if verb == "add" and 1 <= len(words) <= 2 and all(w.isdigit() for w in words):
            groups[int(words[0])] = Group(int(words[0]), int(words[1]) if len(words) == 2 else None)
        elif verb == "del" and arg.isdigit():
            groups.pop(int(arg), None)
        elif verb == "run":
            try:
                commands.append([str(word) for word in json.loads(arg)])
            except (ValueError, TypeError):
                pass  # not from pslaunch: keep guarding the groups
        elif verb == "clear":
            commands.clear()
    stop_groups([g for g in groups.values() if g.alive()], grace)
    for argv in commands:
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=_COMMAND_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass  # nothing left to report to: pslaunch is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
