"""The processes of a job on a node: the verbs pslaunch sends them, and the one way they are stopped.

Every process of the job runs as the leader of a process group of its own, so a signal to the
group reaches everything it started. pslaunch speaks to them in five verbs, whatever carries them
(a signal here, a line to the remote guard or a Ray actor, a frame to a per-node agent, a signal
through mpirun or Slurm): ``TERM`` (stop: SIGTERM, then SIGCONT so that a stopped group gets it at
once), ``KILL``, ``STOP`` and ``CONT`` (Ctrl-Z of pslaunch and ``fg``) and ``END`` (SIGUSR1: a
bundled node ends normally). ``GROUP_SIGNALS`` is what each does to a group; ``SHIM_SIGNALS``
how one travels as a single signal to a rank shim (``rank_shim``) through a launcher that passes
on only some signals (mpirun, an SGE job's agents).

Stopping is one sequence, ``stop``: TERM, up to a grace period for the items to end, then KILL of
what is left; ``stop_groups`` is it for process groups. pslaunch's teardown, a per-node agent, the
watchdog, a rank shim and the test kit all stop through it; the remote guard, a POSIX shell script
that must run where pslaunch's Python may not, writes the same sequence in shell (``guard``).

A group id is its leader's pid, and once every process of a group has ended the system may give
that number to a new, unrelated process (a busy machine wraps around its pids in minutes). So a
group pslaunch started is held as a ``Group``: its id and when its leader started; signals go to
the id only while it is still that group (``Group.ours``), never to a stranger that took the number.

Standard library only, as everything in ``launcher.on_node``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

__all__ = ["VERBS", "GROUP_SIGNALS", "SHIM_SIGNALS", "Group", "leader_start", "signal_group", "group_alive",
           "send_verb", "stop", "stop_groups"]

_Item = TypeVar("_Item")

#: pslaunch's requests to a process of the job, in every backend.
VERBS = ("TERM", "KILL", "STOP", "CONT", "END")
#: What each verb sends to a process group, in order.
GROUP_SIGNALS: dict[str, tuple[int, ...]] = {
    "TERM": (signal.SIGTERM, signal.SIGCONT),
    "KILL": (signal.SIGKILL,),
    "STOP": (signal.SIGSTOP,),
    "CONT": (signal.SIGCONT,),
    "END": (signal.SIGUSR1,),
}
#: The one signal that carries a verb to a rank shim through a launcher that passes some signals
#: on to every rank (mpirun passes SIGUSR1, SIGUSR2, SIGCONT and SIGALRM; a SIGTERM of its own
#: would make it abort the job). KILL has none: it kills the launcher's session instead.
SHIM_SIGNALS: dict[str, int] = {
    "TERM": signal.SIGALRM,
    "STOP": signal.SIGUSR2,
    "CONT": signal.SIGCONT,
    "END": signal.SIGUSR1,
}


def signal_group(pgid: int, *signals: int) -> bool:
    """Send ``signals`` to process group ``pgid`` in order; False when the group is gone (no error)."""
    for sig in signals:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return False
    return True


def send_verb(pgid: int, verb: str) -> bool:
    """Do ``verb`` (one of ``VERBS``) to process group ``pgid``; False when the group is gone."""
    return signal_group(pgid, *GROUP_SIGNALS[verb])


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leader_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc's ``starttime``), or None: no such
    process, or no /proc to ask."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Group:
    """A process group this program started: ``pgid`` (its leader's pid) and ``started``, when the
    leader started (None where /proc cannot say: the id is then trusted as before)."""

    pgid: int
    started: int | None

    @classmethod
    def of(cls, leader: int) -> "Group":
        """The group of ``leader``, a child just started in a session of its own (not reaped yet)."""
        return cls(leader, leader_start(leader))

    def ours(self) -> bool:
        """Whether the id still names this group: its leader lives (or is a zombie), or is gone while
        the id stays taken by members left behind (the system does not hand out a pid that is a
        live group's id). False when another process, started later, holds the number now."""
        if self.started is None:
            return True
        now = leader_start(self.pgid)
        return now is None or now == self.started

    def signal(self, *signals: int) -> bool:
        """``signal_group`` while the group is ours; False when it is gone or the id is another's."""
        return self.ours() and signal_group(self.pgid, *signals)

    def verb(self, verb: str) -> bool:
        """``send_verb`` while the group is ours."""
        return self.signal(*GROUP_SIGNALS[verb])

    def alive(self) -> bool:
        """Whether a process of this group is still there."""
        return self.ours() and group_alive(self.pgid)


def stop(items: Iterable[_Item], *, terminate: Callable[[_Item], object], kill: Callable[[_Item], object],
         alive: Callable[[_Item], bool], grace: float, hurry: Callable[[], bool] = lambda: False,
         tick: float = 0.05) -> list[_Item]:
    """Stop ``items``: ``terminate`` each (all of them: a leader that ended may leave its group behind),
    wait until none is ``alive``, ``grace`` seconds passed or ``hurry()`` (a second Ctrl-C), then
    ``kill`` each. Returns those still alive when the KILL went out. Blocking."""
    items = list(items)
    for item in items:
        terminate(item)
    running = [item for item in items if alive(item)]
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline and not hurry():
        time.sleep(tick)
        running = [item for item in running if alive(item)]
    for item in items:
        kill(item)
    return running


def stop_groups(groups: Iterable[Group], grace: float, tick: float = 0.05) -> list[Group]:
    """``stop`` for process groups: TERM (and CONT), ``grace`` seconds, KILL; a group whose id another
    process took meanwhile is left alone."""
    return stop(groups, terminate=lambda g: g.verb("TERM"), kill=lambda g: g.verb("KILL"),
                alive=lambda g: g.alive(), grace=grace, tick=tick)
