"""The remote guard: a small POSIX-sh wrapper that every process started over ssh runs in.

Why: a remote process must not outlive the launcher. ssh gives the remote side one reliable
signal — its stdin reaches EOF when the channel closes (pslaunch exited, was interrupted or was
SIGKILLed, or the network went away). The guard

1. reads the environment from stdin (a line count, then ``export NAME='value'`` lines), so no
   value ever appears on a command line or in a file;
2. changes to the working directory;
3. starts the command in its own session / process group (``setsid``; ``set -m`` where there is
   no setsid), with stdin from /dev/null, and reports its pid as a marker line on stderr;
4. watches stdin: ``TERM`` (SIGTERM, then SIGCONT so a stopped group gets it), ``KILL``,
   ``STOP`` / ``CONT`` (Ctrl-Z of pslaunch) and ``END`` (SIGUSR1: a bundled node ends normally)
   lines signal the group; at EOF the group gets SIGTERM and, after the grace period, SIGKILL;
5. when the command ends, stops what is left of its group (TERM, grace, KILL) and exits with the
   command's exit code.
"""

from __future__ import annotations

import shlex
from typing import Mapping, Sequence

__all__ = ["GUARD_SCRIPT", "remote_command", "env_payload"]

GUARD_SCRIPT = r"""
g=$1; d=$2; strict=$3; shift 3
exec 3<&0
IFS= read -r n || exit 125
s=''; i=0
while [ "$i" -lt "$n" ]; do IFS= read -r l || exit 125; s="$s$l
"; i=$((i+1)); done
eval "$s"; unset s l n i
if [ -n "$d" ] && ! cd "$d" 2>/dev/null; then
  if [ "$strict" = 1 ]; then echo "pslaunch guard: cannot cd to $d" >&2; exit 126; fi
  echo "pslaunch guard: no directory $d here, running in $HOME" >&2; cd || exit 126
fi
if command -v setsid >/dev/null 2>&1; then setsid "$@" </dev/null 3<&- &
else set -m; "$@" </dev/null 3<&- & fi
p=$!
printf '\037PSLAUNCH-PID %s\n' "$p" >&2
( while IFS= read -r c; do
    case $c in
      TERM) kill -s TERM -- "-$p" 2>/dev/null; kill -s CONT -- "-$p" 2>/dev/null;;
      KILL) kill -s KILL -- "-$p" 2>/dev/null;;
      STOP) kill -s STOP -- "-$p" 2>/dev/null;;
      CONT) kill -s CONT -- "-$p" 2>/dev/null;;
      END) kill -s USR1 -- "-$p" 2>/dev/null;;
    esac
  done
  kill -s TERM -- "-$p" 2>/dev/null; kill -s CONT -- "-$p" 2>/dev/null; t=0
  while [ "$t" -lt "$g" ] && kill -s 0 -- "-$p" 2>/dev/null; do sleep 1; t=$((t+1)); done
  kill -s KILL -- "-$p" 2>/dev/null ) <&3 &
w=$!
exec 3<&-
wait "$p" 2>/dev/null; r=$?
kill "$w" 2>/dev/null
if kill -s 0 -- "-$p" 2>/dev/null; then
  kill -s TERM -- "-$p" 2>/dev/null; kill -s CONT -- "-$p" 2>/dev/null; t=0
  while [ "$t" -lt "$g" ] && kill -s 0 -- "-$p" 2>/dev/null; do sleep 1; t=$((t+1)); done
  kill -s KILL -- "-$p" 2>/dev/null
fi
exit "$r"
""".strip()


def remote_command(argv: Sequence[str], cwd: str | None, strict_cwd: bool, grace: float) -> str:
    """The command line handed to the remote login shell: the guard around ``argv``.

    Every piece is ``shlex.quote``-d: spaces, quotes, ``$`` and backslashes in ``argv`` reach the
    process unchanged (the login shell must be POSIX-like: sh, bash, dash, zsh, ksh).
    """
    pieces = ["sh", "-c", GUARD_SCRIPT, "pslaunch-guard", str(max(1, int(round(grace)))), cwd or "",
              "1" if strict_cwd else "0", *argv]
    return "exec " + shlex.join(pieces)


def env_payload(env: Mapping[str, str]) -> bytes:
    """The environment as the guard reads it from stdin: a line count, then ``export`` lines."""
    script = "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items())
    count = script.count("\n") + 1 if script else 0
    return f"{count}\n{script}\n".encode("utf-8", "surrogateescape") if script else b"0\n"
