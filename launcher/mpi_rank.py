"""What each MPI rank runs: ``python -m launcher.mpi_rank`` maps the rank to its process of the plan.

The mpi backend starts one ``mpirun`` for the whole job; every rank runs this module, which

1. reads its rank from ``OMPI_COMM_WORLD_RANK`` (Open MPI), ``PMI_RANK`` (MPICH / Hydra) or
   ``PMIX_RANK`` (or from the variable ``--rank-from NAME`` names: the slurm backend's
   ``SLURM_PROCID``, the sge backend's host agent), and its entry from the plan in
   ``PSLAUNCH_MPI_PLAN`` (JSON, one entry per rank; ``payload`` makes it);
2. builds the environment: the contract variables of that entry, plus the ``--env`` values the
   launcher exported as ``PSLAUNCH_ENV_<i>`` (only those meant for this role, under their real
   names), without the launcher's own transport variables;
3. starts the command in its own process group, passes SIGTERM / SIGINT on to that group, and
   stops it when its own parent (mpirun's daemon) dies (``PR_SET_PDEATHSIG``);
4. writes a marker line with the pid at start and the exit status at the end on stderr (the
   launcher reads them from mpirun's tagged output) and exits with the command's exit code.

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

__all__ = ["main", "payload", "PLAN_VARIABLE", "ENV_PREFIX", "rank_from_environ"]

PLAN_VARIABLE = "PSLAUNCH_MPI_PLAN"
ENV_PREFIX = "PSLAUNCH_ENV_"
_MARKER = "\x1fPSLAUNCH-"
_PR_SET_PDEATHSIG = 1


def payload(specs, grace: float, pythonpath: str) -> dict[str, str]:
    """The variables that carry the processes ``specs`` (``ProcessSpec``s, in rank order) to
    their ranks: the plan in ``PSLAUNCH_MPI_PLAN`` and each distinct ``--env`` value once, as
    ``PSLAUNCH_ENV_<i>``. Values travel only here, never on a command line. Holds secrets."""
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


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: mpirun's own signal forwarding still applies


def main(argv: list[str] | None = None) -> int:
    """Run this rank's process of the plan; returns its exit code (128+signal for a signal).

    ``argv`` (default ``sys.argv[1:]``) may be ``--rank-from NAME``."""
    args = sys.argv[1:] if argv is None else argv
    rank_variable = args[1] if len(args) == 2 and args[0] == "--rank-from" else None
    try:
        rank = rank_from_environ(os.environ, rank_variable)
        plan = json.loads(os.environ[PLAN_VARIABLE])
        entry = plan[rank]
    except (RuntimeError, KeyError, IndexError, ValueError) as exc:
        print(f"pslaunch mpi_rank: cannot find this rank's process: {exc}", file=sys.stderr)
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
    try:
        child = subprocess.Popen(entry["argv"], env=env, cwd=entry.get("cwd") or None, start_new_session=True)
    except OSError as exc:
        print(f"cannot start {entry['argv'][0]!r}: {exc.strerror or exc}", file=sys.stderr)
        print(f"{_MARKER}EXIT 127", file=sys.stderr, flush=True)
        return 127
    print(f"{_MARKER}PID {child.pid}", file=sys.stderr, flush=True)
    stopping: list[int] = []

    def forward(signum, frame):  # noqa: ARG001
        stopping.append(signum)
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    grace = float(entry.get("grace", 5))
    killed_at = None
    while True:
        try:
            rc = child.wait(0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent and not stopping:
            forward(signal.SIGTERM, None)  # parent gone without PDEATHSIG (not Linux)
        if stopping and killed_at is None:
            killed_at = time.monotonic() + grace
        if killed_at is not None and time.monotonic() > killed_at:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(child.pid, signal.SIGKILL)  # leftovers of its group
    except ProcessLookupError:
        pass
    code = 128 - rc if rc < 0 else rc
    status = f"SIGNAL {-rc}" if rc < 0 else f"EXIT {rc}"
    print(f"{_MARKER}{status}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
