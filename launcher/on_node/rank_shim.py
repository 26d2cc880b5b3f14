"""What each MPI rank runs: ``python -m launcher.on_node.rank_shim`` maps the rank to its process of the plan.

The mpi backend starts one ``mpirun`` for the whole job; every rank runs this module, which

1. reads its rank from ``OMPI_COMM_WORLD_RANK`` (Open MPI), ``PMI_RANK`` (MPICH / Hydra) or
   ``PMIX_RANK`` (or from the variable ``--rank-from NAME`` names: the slurm backend's
   ``SLURM_PROCID``, the sge backend's host agent), and its entry from the plan in
   ``PSLAUNCH_MPI_PLAN`` (JSON, one entry per rank; ``payload`` makes it);
2. builds the environment: the contract variables of that entry, plus the ``--env`` values the
   launcher exported as ``PSLAUNCH_ENV_<i>`` (only those meant for this role, under their real
   names), without the launcher's own transport variables;
3. starts the command in its own process group, passes SIGTERM / SIGINT / SIGHUP (each with a
   SIGCONT) and SIGUSR1 on to that group, stops it on SIGUSR2 and continues it on SIGCONT (what
   pslaunch sends through mpirun for Ctrl-Z), takes SIGALRM for SIGTERM (pslaunch's stop, which
   mpirun passes on instead of aborting the job), and stops it when its own parent (mpirun's daemon)
   dies (``PR_SET_PDEATHSIG``); with ``--no-forward`` (under Slurm, which signals every process of
   a step itself) it passes on only a SIGCONT with the stopping signals;
4. writes a marker line with the pid at start and the exit status at the end on stderr (the
   launcher reads them from mpirun's tagged output) and exits 0: pslaunch, not mpirun, decides
   what a failure stops (an mpirun aborting by itself loses the other ranks' statuses);
5. is the rank's link guard: pslaunch pings every rank with a SIGCONT through mpirun every few
   seconds (mpirun's daemons carry it over the network to this host; a running process ignores
   it: a SIGCONT continues the group only after a SIGUSR2 stopped it); each one is answered with a
   ``PONG`` marker line, and when none came for the entry's ``link`` seconds (a partition:
   mpirun's daemons notice nothing) the process group is stopped as on SIGTERM. A SIGUSR2
   (Ctrl-Z) holds that clock until the next SIGCONT.

Only the standard library.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from pscontract import hand_key_over

from .process_groups import GROUP_SIGNALS, SHIM_SIGNALS, Group, stop

__all__ = ["main", "payload", "PLAN_VARIABLE", "ENV_PREFIX", "rank_from_environ"]

PLAN_VARIABLE = "PSLAUNCH_MPI_PLAN"
ENV_PREFIX = "PSLAUNCH_ENV_"
_MARKER = "\x1fPSLAUNCH-"
_PR_SET_PDEATHSIG = 1


def payload(specs, grace: float, pythonpath: str, link=lambda spec: 0) -> dict[str, str]:
    """The variables that carry the processes ``specs`` (``ProcessSpec``s, in rank order) to
    their ranks: the plan in ``PSLAUNCH_MPI_PLAN`` and each distinct ``--env`` value once, as
    ``PSLAUNCH_ENV_<i>``. Values travel only here, never on a command line. Holds secrets.
    ``link(spec)``: the seconds without a ping after which that rank stops its process group as
    lost (0: never; see ``_Link``)."""
    values: dict[tuple[str, str, str], int] = {}
    for spec in specs:
        for var in spec.user_env:
            values.setdefault((var.name, var.value, var.scope), len(values))
    entries = [{
        "name": spec.name,
        "argv": list(spec.argv),
        "env": spec.env,
        "user_env": [(v.name, values[(v.name, v.value, v.scope)]) for v in spec.user_env],
        "cwd": spec.cwd,
        "grace": grace,
        "PYTHONPATH": pythonpath,
        "link": link(spec),
    } for spec in specs]
    env = {PLAN_VARIABLE: json.dumps(entries)}
    env.update({f"{ENV_PREFIX}{i}": value for (_, value, _), i in values.items()})
    return env


def rank_from_environ(environ, name: str | None = None) -> int:
    """This process's rank: from variable ``name`` if given, else from the MPI launcher's.
    Raises ``RuntimeError`` when there is none."""
    names = (name,) if name else ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    for candidate in names:
        value = environ.get(candidate)
        if value is not None and value.isdigit():
            return int(value)
    raise RuntimeError(f"no rank in the environment ({' / '.join(names)})")


class _Link:
    """pslaunch's pings (SIGCONT), answered on stderr; lost after ``timeout`` s without one (0: never).

    A SIGCONT continues the process group (``resume``) only after a SIGUSR2 stopped it: a ping must
    not continue a process that stopped itself."""

    def __init__(self, timeout: float, resume) -> None:
        self.timeout = timeout
        self.resume = resume
        self.heard = time.monotonic()
        self.held = False

    def on_cont(self, signum, frame) -> None:  # noqa: ARG002
        if self.held:
            self.resume()
        self.heard = time.monotonic()
        self.held = False
        try:
            os.write(2, f"{_MARKER}PONG\n".encode())
        except OSError:
            pass

    def hold(self) -> None:
        self.held = True

    def lost(self) -> bool:
        return self.timeout > 0 and not self.held and time.monotonic() - self.heard > self.timeout


def _also(first, then):
    """A signal handler that runs the handler ``first`` and then ``then()``."""

    def handler(signum, frame):
        if callable(first):
            first(signum, frame)
        then()

    return handler


def _say(text: str) -> None:
    """A marker line on stderr in one ``write``: mpirun forwards what it reads as it comes, and its own
    lines (``Forwarding signal 14 to job``, when pslaunch stops the job) could land inside a marker
    written in two pieces (``print`` writes the text and the newline apart), which then reads as no
    marker at all."""
    try:
        os.write(2, f"{_MARKER}{text}\n".encode())
    except OSError:
        pass


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: mpirun's own signal forwarding still applies


def _options(args: list[str]) -> tuple[str | None, bool]:
    """``(--rank-from NAME or None, whether to pass signals on)`` from the command line."""
    rank_variable, passing = None, True
    rest = list(args)
    while rest:
        word = rest.pop(0)
        if word == "--rank-from" and rest:
            rank_variable = rest.pop(0)
        elif word == "--no-forward":
            passing = False
        else:
            raise RuntimeError(f"unknown argument {word!r} (usage: [--rank-from NAME] [--no-forward])")
    return rank_variable, passing


def main(argv: list[str] | None = None) -> int:
    """Run this rank's process of the plan; returns 0 once its status is reported (125: no process
    for this rank). ``argv`` (default ``sys.argv[1:]``) may hold ``--rank-from NAME`` and
    ``--no-forward`` (the launcher signals every process of the job itself, as Slurm does: pass no
    signal on, only time the grace period and keep the process group from dying of them)."""
    try:
        rank_variable, passing = _options(sys.argv[1:] if argv is None else argv)
    except RuntimeError as exc:
        print(f"pslaunch rank_shim: {exc}", file=sys.stderr)
        return 125
    try:
        rank = rank_from_environ(os.environ, rank_variable)
        plan = json.loads(os.environ[PLAN_VARIABLE])
        entry = plan[rank]
    except (RuntimeError, KeyError, IndexError, ValueError) as exc:
        print(f"pslaunch rank_shim: cannot find this rank's process: {exc}", file=sys.stderr)
        return 125
    _die_with_parent()
    parent = os.getppid()
    own = {PLAN_VARIABLE, rank_variable if (rank_variable or "").startswith("PSLAUNCH_") else None}
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k not in own}
    if "PYTHONPATH" in entry:
        env["PYTHONPATH"] = entry["PYTHONPATH"]
    env.update(entry["env"])
    for name, index in entry["user_env"]:
        env[name] = os.environ.get(f"{ENV_PREFIX}{index}", "")
    # Held until the child exists (handlers, unlike ignored signals, do not pass to the child).
    early: list[int] = []
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT, signal.SIGALRM):
        signal.signal(sig, lambda signum, frame: early.append(signum))
    key_pipe = hand_key_over(env)  # the key through a pipe, never in the child's environment
    try:
        child = subprocess.Popen(entry["argv"], env=env, cwd=entry.get("cwd") or None, start_new_session=True,
                                 pass_fds=() if key_pipe is None else (key_pipe,))
    except OSError as exc:
        print(f"cannot start {entry['argv'][0]!r}: {exc.strerror or exc}", file=sys.stderr)
        _say("EXIT 127")
        return 0  # the status is in the marker (see the end of main)
    finally:
        if key_pipe is not None:
            os.close(key_pipe)
    _say(f"PID {child.pid}")
    group = Group.of(child.pid)  # signals never reach a stranger that took the id once the group ended
    stopping: list[int] = []

    def to_group(*signals: int) -> None:
        group.signal(*signals)

    def forward(signum, frame):  # noqa: ARG001
        stopping.append(signum)
        if passing or os.getppid() != parent:  # PR_SET_PDEATHSIG's signal reached this process alone
            to_group(signum, signal.SIGCONT)  # a stopped group gets the signal only once continued
        else:
            to_group(signal.SIGCONT)  # the launcher signalled the group too; stopped, it gets it now

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    # What pslaunch sends through mpirun (which passes SIGUSR1, SIGUSR2, SIGCONT and SIGALRM to every
    # rank): SIGUSR1 ends a bundled node normally, SIGUSR2 stops the group (Ctrl-Z), SIGCONT continues
    # it, SIGALRM stops the job as SIGTERM does. A SIGTERM to mpirun would make it abort the job, and
    # an aborting mpirun kills the ranks after 1 s and drops their output: the exit statuses too.
    passed = {SHIM_SIGNALS[verb]: GROUP_SIGNALS[verb][0] for verb in ("STOP", "CONT", "END")}
    for sig, what in passed.items():
        signal.signal(sig, lambda signum, frame, what=what: to_group(what) if passing else None)
    terming = SHIM_SIGNALS["TERM"]  # SIGALRM
    signal.signal(terming, lambda signum, frame: forward(signal.SIGTERM, frame) if passing else None)
    for sig in early if passing else ():
        if sig == terming:
            forward(signal.SIGTERM, None)
        else:
            to_group(passed[sig])
    link = _Link(float(entry.get("link", 0)), lambda: to_group(signal.SIGCONT))
    signal.signal(signal.SIGCONT, link.on_cont)
    signal.signal(signal.SIGUSR2, _also(signal.getsignal(signal.SIGUSR2), link.hold))
    grace = float(entry.get("grace", 5))
    while True:
        try:
            rc = child.wait(0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if (os.getppid() != parent or link.lost()) and not stopping:
            forward(signal.SIGTERM, None)  # parent gone without PDEATHSIG (not Linux), or pslaunch unheard of
        if stopping:  # the TERM went out (``forward``): the grace period, then KILL, as every stop does
            stop([group], terminate=lambda g: None, kill=lambda g: g.signal(signal.SIGKILL),
                 alive=lambda g: child.poll() is None, grace=grace, tick=0.2)
            rc = child.wait()
            break
    # mpirun passes later signals to every rank, this one too: they must not kill it on its way
    # out (Python puts default handlers back while it shuts down), mpirun would call that a failure.
    for sig in (*passed, terming):
        signal.signal(sig, signal.SIG_IGN)
    group.signal(signal.SIGKILL)  # leftovers of its group
    status = f"SIGNAL {-rc}" if rc < 0 else f"EXIT {rc}"
    _say(status)
    # pslaunch has the real status from the marker. Exiting 0 keeps mpirun from aborting the job
    # by itself: it would kill the other ranks before their own exit markers got through, and a
    # signal pslaunch sends meanwhile can crash it (Open MPI 4.1). pslaunch decides and stops the rest.
    return 0


if __name__ == "__main__":
    sys.exit(main())
