"""What runs inside pslaunch's SGE job: the master task and one agent per host.

``python -m launcher.on_node.sge_job master DIR`` is the job itself (``qsub ... -b y``). It

1. writes the hosts SGE granted (``$PE_HOSTFILE``: host and slots per line) to ``DIR/hosts.json``;
2. waits for pslaunch to answer with the plan for them, ``DIR/plan.json`` (mode 0600: it holds the
   ``--env`` values, which therefore never pass through ``qsub -v`` and the qmaster's spool);
3. starts one agent per host of the plan with ``qrsh -inherit`` (tight integration: SGE accounts
   the agents to the job and kills them with it), and exits with the first non-zero exit code
   among them.

``python -m launcher.on_node.sge_job agent DIR HOST`` starts the processes the plan puts on HOST,
each as ``python -m launcher.on_node.rank_shim`` (which finds its process by index, sets its environment
and reports its pid and exit status as marker lines), with stdout and stderr in ``DIR/<i>.out`` /
``DIR/<i>.err``, where pslaunch reads them. It passes each request pslaunch appends to
``DIR/control`` to them as a signal (``SIGNALS``: TERM, then SIGKILL after the grace period; Ctrl-Z
and ``fg``; the end of the bundled nodes), which ``rank_shim`` passes on to its process group; when
``qdel`` kills the agent, each ``rank_shim`` stops its process group as on TERM.

One agent per host, not one ``qrsh -inherit`` per process: SGE allows a host only as many
``qrsh -inherit`` tasks as it granted slots there, while the plan may put more processes on a host
(servers and the scheduler go round-robin beside the workers). Only the standard library.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from .process_groups import SHIM_SIGNALS

__all__ = ["main", "HOSTS_FILE", "PLAN_FILE", "CONTROL_FILE", "SIGNALS", "RANK_VARIABLE", "read_pe_hostfile"]

HOSTS_FILE = "hosts.json"
PLAN_FILE = "plan.json"
#: pslaunch's requests to the agents, one per line, in order (``SIGNALS``' keys).
CONTROL_FILE = "control"
#: The signal an agent sends each rank shim for a request (``process_groups.SHIM_SIGNALS``).
SIGNALS = SHIM_SIGNALS
#: The variable that tells ``rank_shim`` its index in the plan.
RANK_VARIABLE = "PSLAUNCH_SGE_INDEX"
#: Seconds the master waits for pslaunch's plan before it gives up.
PLAN_WAIT = 600
_TICK = 0.1


def read_pe_hostfile(text: str) -> list[tuple[str, int]]:
    """``[(host, slots)]`` from a ``$PE_HOSTFILE`` (``host slots queue processors`` per line),
    a host listed on several lines (several queues) once with its slots added."""
    slots: dict[str, int] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[1].isdigit():
            slots[words[0]] = slots.get(words[0], 0) + int(words[1])
    return list(slots.items())


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def master(jobdir: str) -> int:
    """The job's master task; returns its exit code."""
    try:
        with open(os.environ["PE_HOSTFILE"], encoding="utf-8") as fh:
            hosts = read_pe_hostfile(fh.read())
    except (KeyError, OSError) as exc:
        print(f"pslaunch sge job: no parallel-environment host file (was the job submitted with -pe?): {exc}",
              file=sys.stderr)
        return 1
    _write_atomically(os.path.join(jobdir, HOSTS_FILE), json.dumps({"hosts": hosts}))
    plan_path = os.path.join(jobdir, PLAN_FILE)
    deadline = time.monotonic() + PLAN_WAIT
    while not os.path.exists(plan_path):
        if time.monotonic() > deadline:
            print(f"pslaunch sge job: no plan from pslaunch in {plan_path} after {PLAN_WAIT} s", file=sys.stderr)
            return 1
        time.sleep(_TICK / 2)
    with open(plan_path, encoding="utf-8") as fh:
        plan = json.load(fh)
    qrsh = os.path.join(os.environ.get("SGE_BINARY_PATH", ""), "qrsh")
    qrsh = qrsh if os.path.isfile(qrsh) else "qrsh"
    agents = []
    for host in dict.fromkeys(plan["hosts"]):
        # qrsh -inherit joins its words into one command line for a shell on the host: quote each.
        words = [plan["python"], "-m", "launcher.on_node.sge_job", "agent", jobdir, host]
        agents.append(subprocess.Popen([qrsh, "-inherit", "-nostdin", host, *map(shlex.quote, words)],
                                       stdin=subprocess.DEVNULL))
    codes = [agent.wait() for agent in agents]
    return next((code for code in codes if code != 0), 0)


def agent(jobdir: str, host: str) -> int:
    """Start and watch the plan's processes on ``host``; returns the first non-zero exit code."""
    with open(os.path.join(jobdir, PLAN_FILE), encoding="utf-8") as fh:
        plan = json.load(fh)
    base = dict(os.environ, **plan["variables"])
    children = []
    for index, where in enumerate(plan["hosts"]):
        if where != host:
            continue
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        out = os.open(os.path.join(jobdir, f"{index}.out"), flags, 0o600)
        err = os.open(os.path.join(jobdir, f"{index}.err"), flags, 0o600)
        try:
            children.append(subprocess.Popen(
                [plan["python"], "-m", "launcher.on_node.rank_shim", "--rank-from", RANK_VARIABLE],
                env=dict(base, **{RANK_VARIABLE: str(index)}), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                # Out of the agent's process group, which is what qdel kills unless the cluster
                # kills by group id too: rank_shim then outlives the agent by a moment and stops
                # its process group when the agent dies (it has PR_SET_PDEATHSIG).
                start_new_session=True))
        finally:
            os.close(out)
            os.close(err)
    control = _Requests(os.path.join(jobdir, CONTROL_FILE))
    while any(child.poll() is None for child in children):
        for verb in control.new():
            for child in children:
                if child.poll() is None and verb in SIGNALS:
                    child.send_signal(SIGNALS[verb])
        time.sleep(_TICK)
    codes = [128 - child.returncode if child.returncode < 0 else child.returncode for child in children]
    return next((code for code in codes if code != 0), 0)


class _Requests:
    """The lines pslaunch appends to a file; ``new`` returns those added since the last call."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""

    def new(self) -> list[str]:
        try:
            with open(self._path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line not ended yet
        return [line.decode("ascii", "replace").strip() for line in lines]


def main(argv: list[str] | None = None) -> int:
    """``master DIR`` or ``agent DIR HOST``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "master":
        return master(args[1])
    if len(args) == 3 and args[0] == "agent":
        return agent(args[1], args[2])
    print("usage: python -m launcher.on_node.sge_job master DIR | agent DIR HOST", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
