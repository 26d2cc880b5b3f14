"""The remote guard: a small POSIX-sh wrapper that every process started over ssh runs in.

Why: a remote process must not outlive the launcher, nor its link to it. ssh gives the remote side
one signal when pslaunch goes away cleanly — its stdin reaches EOF when the channel closes
(pslaunch exited, was interrupted or was SIGKILLed) — but none when the network between them
breaks: then nothing arrives at all. So pslaunch writes ``PING`` on every guard's stdin every few
seconds, and a guard that hears nothing for the link timeout stops its command. The guard

1. reads the environment from stdin (a line count, then ``export NAME='value'`` lines), so no
   value ever appears on a command line or in a file; the job key it moves out of the environment
   into a here-document on the command's file descriptor 4 (``PSLAUNCH_JOB_KEY_FD=4``), from which
   the runtime reads it: it is in no process's environment on the host;
2. changes to the working directory;
3. starts the command in its own session / process group (``setsid``; ``set -m`` where there is
   no setsid), with stdin from /dev/null, and reports its pid as a marker line on stderr;
4. watches stdin: ``PING`` (answered with a ``PONG`` marker line, pslaunch's sign that the link
   and the host are alive), ``TERM`` (SIGTERM, then SIGCONT so a stopped group gets it), ``KILL``,
   ``STOP`` / ``CONT`` (Ctrl-Z of pslaunch: no pings come while pslaunch is stopped, so ``STOP``
   also holds the link timeout until the next line) and ``END`` (SIGUSR1: a bundled node ends
   normally) lines signal the group; ``SIG N`` sends signal number N to the command alone (the
   runtime's own signals: its Python stack, a preemption); at EOF, or after the link timeout without a
   line, the group gets SIGTERM and, after the grace period, SIGKILL;
5. when the command ends, stops what is left of its group (TERM, grace, KILL) and exits with the
   command's exit code.

The link timeout is counted by a subshell that the lines reach as signals (SIGUSR1: a line came;
SIGUSR2: ``STOP``). The guard reads no line before that subshell has set its traps (its pid comes
back through a pipe it closes only then): a signal that came first would kill it with the signal's
default action, and the command would run on with no link timeout.
"""

from __future__ import annotations

import shlex
from typing import Mapping, Sequence

from pscontract import runtime_signals

__all__ = ["GUARD_SCRIPT", "remote_command", "guard_argv", "env_payload", "PING", "PONG"]

GUARD_SCRIPT = r"""
g=$1; l=$2; d=$3; strict=$4; ign=$5; shift 5
[ -z "$ign" ] || trap '' $ign
exec 3<&0
IFS= read -r n || exit 125
s=''; i=0
while [ "$i" -lt "$n" ]; do IFS= read -r x || exit 125; s="$s$x
"; i=$((i+1)); done
eval "$s"; unset s x n i
jk=
if [ -n "${PSLAUNCH_JOB_KEY:-}" ]; then
  jk=$PSLAUNCH_JOB_KEY; unset PSLAUNCH_JOB_KEY; PSLAUNCH_JOB_KEY_FD=4; export PSLAUNCH_JOB_KEY_FD
fi
if [ -n "$d" ] && ! cd "$d" 2>/dev/null; then
  if [ "$strict" = 1 ]; then echo "pslaunch guard: cannot cd to $d" >&2; exit 126; fi
  echo "pslaunch guard: no directory $d here, running in $HOME" >&2; cd || exit 126
fi
if command -v setsid >/dev/null 2>&1; then setsid "$@" </dev/null 3<&- 4<<PSLAUNCH_JOB_KEY &
$jk
PSLAUNCH_JOB_KEY
else set -m; "$@" </dev/null 3<&- 4<<PSLAUNCH_JOB_KEY &
$jk
PSLAUNCH_JOB_KEY
fi
unset jk
p=$!
printf '\037PSLAUNCH-PID %s\n' "$p" >&2
stop() {
  kill -s TERM -- "-$p" 2>/dev/null; kill -s CONT -- "-$p" 2>/dev/null; t=0
  while [ "$t" -lt "$g" ] && kill -s 0 -- "-$p" 2>/dev/null; do sleep 1; t=$((t+1)); done
  kill -s KILL -- "-$p" 2>/dev/null
}
k=
if [ "$l" -gt 0 ]; then
  k=$( ( trap 'a=-1; h=0' USR1; trap 'h=1' USR2; a=0; h=0; exec >/dev/null
         while [ "$a" -lt "$l" ]; do sleep 1; [ "$h" = 1 ] || a=$((a+1)); done
         stop ) </dev/null 3<&- & echo "$!" )
fi
( while IFS= read -r c; do
    if [ -n "$k" ]; then
      if [ "$c" = STOP ]; then kill -s USR2 "$k" 2>/dev/null; else kill -s USR1 "$k" 2>/dev/null; fi
    fi
    case $c in
      PING) printf '\037PSLAUNCH-PONG\n' >&2;;
      TERM) kill -s TERM -- "-$p" 2>/dev/null; kill -s CONT -- "-$p" 2>/dev/null;;
      KILL) kill -s KILL -- "-$p" 2>/dev/null;;
      STOP) kill -s STOP -- "-$p" 2>/dev/null;;
      CONT) kill -s CONT -- "-$p" 2>/dev/null;;
      END) kill -s USR1 -- "-$p" 2>/dev/null;;
      SIG\ [0-9]*) kill -"${c#SIG }" "$p" 2>/dev/null;;
    esac
  done
  stop ) <&3 &
w=$!
exec 3<&-
wait "$p" 2>/dev/null; r=$?
kill "$w" $k 2>/dev/null
if kill -s 0 -- "-$p" 2>/dev/null; then stop; fi
exit "$r"
""".strip()

#: What pslaunch writes to a guard to show the link is alive, and the marker the guard answers with.
PING = b"PING\n"
PONG = b"\x1fPSLAUNCH-PONG\n"


def remote_command(argv: Sequence[str], cwd: str | None, strict_cwd: bool, grace: float, link_timeout: float = 0) -> str:
    """The command line handed to the remote login shell: the guard around ``argv``.

    ``link_timeout``: seconds without a line from pslaunch after which the guard stops the command
    (0: never; whole seconds, at least 1). Every piece is ``shlex.quote``-d: spaces, quotes, ``$``
    and backslashes in ``argv`` reach the process unchanged (the login shell must be POSIX-like:
    sh, bash, dash, zsh, ksh).
    """
    link = max(1, int(round(link_timeout))) if link_timeout > 0 else 0
    return "exec " + shlex.join(guard_argv(argv, cwd, strict_cwd, grace, link))


def guard_argv(argv: Sequence[str], cwd: str | None, strict_cwd: bool, grace: float, link: int = 0) -> list[str]:
    """``sh -c GUARD_SCRIPT`` around ``argv`` with its settings (``link``: whole seconds, 0 for none).

    The guard ignores the runtime's own signals (``pscontract.runtime_signals``) before it starts
    ``argv``, which inherits that until its runtime handles them: one that comes first does nothing.
    """
    ignored = " ".join(str(signum) for signum in runtime_signals())
    return ["sh", "-c", GUARD_SCRIPT, "pslaunch-guard", str(max(1, int(round(grace)))), str(link), cwd or "",
            "1" if strict_cwd else "0", ignored, *argv]


def env_payload(env: Mapping[str, str]) -> bytes:
    """The environment as the guard reads it from stdin: a line count, then ``export`` lines."""
    script = "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items())
    count = script.count("\n") + 1 if script else 0
    return f"{count}\n{script}\n".encode("utf-8", "surrogateescape") if script else b"0\n"
