"""The slurm backend: the whole job as one Slurm job step (``--launcher slurm``).

**Hosts.** Inside an allocation (``SLURM_JOB_ID`` in pslaunch's environment: under ``salloc`` or in
an ``sbatch`` script) the job runs on that allocation's nodes. Outside one, pslaunch asks for one
first: ``salloc --no-shell -n N -J pslaunch-ID <--slurm-args>``, one task per process, waits
until Slurm grants it and cancels it at the end. It does not let ``srun`` allocate and start at
once because the plan needs the nodes before anything starts (the scheduler's address is the first
node's). ``scontrol show job -d`` gives the nodes and each node's CPUs; a node's slots are its
CPUs divided by the CPUs per task. Placement then follows the usual rules.

**One step.** ``srun --jobid J -n N --distribution=arbitrary --overcommit --label ... python -m
launcher.on_node.rank_shim --rank-from SLURM_PROCID`` with ``SLURM_HOSTFILE`` naming the node of each task,
in plan order: task i is process i of the plan, on the node the plan gave it. ``rank_shim`` finds its
process by ``SLURM_PROCID`` as it does by MPI rank under mpirun. The plan and the ``--env`` values
travel in srun's environment (Slurm's environment propagation, ``--export=ALL``), never on a
command line; ``salloc``, ``squeue``, ``scancel`` and ``scontrol`` get none of the ``--env`` values.

**Output.** ``--label`` prefixes every line with its task number; the backend sends each line to
its process and reads ``rank_shim``'s pid and exit-status markers. srun's own per-task exit lines
are shown with ``-v`` only (pslaunch reports failures itself).

**Signals.** Slurm signals every process of a step (each task's process tree with
proctrack/linuxproc, the step's cgroup with proctrack/cgroup), so ``rank_shim`` runs with
``--no-forward``: it passes nothing on, it only times the grace period. Stopping is ``scancel
--signal=TERM J.S`` (srun's own reaction to SIGTERM would kill the step at once), ``rank_shim``
SIGKILLs its process group after the grace period, ``--signal=KILL`` follows; Ctrl-Z is
``--signal=STOP`` and ``fg`` ``--signal=CONT``; the end of the bundled nodes is ``--signal=USR1``.
At the end pslaunch cancels its step if it still runs and the allocation if it made it, and waits
until ``squeue`` no longer lists them. When pslaunch dies, the watchdog stops srun (which ends its
step) and runs ``scancel`` on the allocation it made.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time

from ..errors import LaunchError, PlacementError, SpawnError
from ..observe.output import LineSplitter
from ..on_node.children import READ_SIZE, child_environ
from ..on_node.process_groups import GROUP_SIGNALS
from ..on_node.rank_shim import payload
from ..planning.hostfile import Host
from ..planning.plan import Plan, make_plan
from .base import ProcessHandle, drain, route_block
from .batch import (
    BatchBackend,
    private_dir,
    read_lines,
    refuse_host_flags,
    refuse_worker_scope,
    require_tools,
    run_tool,
    split_args,
    tool_environ,
    with_hosts,
)
from .local import LocalHandle, _launcher_root
from .shim import ShimHandle

__all__ = ["SlurmBackend", "salloc_argv", "srun_argv", "parse_job_nodes", "PENDING_HOST"]

#: Where the plan puts processes while Slurm has not granted the allocation yet (``--dry-run``).
PENDING_HOST = Host("<slurm-node>")
#: Pending reasons that waiting does not cure: the request exceeds what the cluster or the
#: account may ever run. pslaunch cancels such a job instead of waiting forever.
HOPELESS_REASONS = frozenset({
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
    "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed", "DependencyNeverSatisfied",
})
_LABEL = re.compile(r"^ *(\d+): ?(.*)$", re.S)
# srun's lines that repeat what pslaunch reports itself (per-task exits), or say that the cluster
# does no CPU binding anyway (pslaunch asks for none): shown with -v only.
_ROUTINE = re.compile(r"^srun: (error: \S+: tasks? [\d,\-]+: (Exited with exit code \d+|Killed|Terminated)"
                      r"|cluster configuration lacks support for cpu binding)")
_SLURMSTEPD = re.compile(r"^slurmstepd(-\S+)?: ")
# What Slurm says when pslaunch stops the step or cancels its allocation.
_STOPPED = re.compile(r"^(slurmstepd(-\S+)?: error: \*\*\* (STEP|JOB) \S+ ON \S+ CANCELLED AT "
                      r"|srun: (Force Terminated|Job step aborted|forcing job termination))")
_ALLOCATION = re.compile(r"(Pending|Granted) job allocation (\d+)")
_POLL = 0.2
_REASON_EVERY = 1.0


def salloc_argv(count: int, name: str, user_args: list[str]) -> list[str]:
    """The allocation pslaunch asks for outside an allocation: one task per process."""
    return ["salloc", "--no-shell", *user_args, "-n", str(count), "-J", name]


def srun_argv(job: str, plan: Plan, name: str, python: str, user_args: list[str]) -> list[str]:
    """The one step that starts every process of ``plan`` (``SLURM_HOSTFILE`` places the tasks)."""
    nodes = {spec.host.name for spec in plan.processes}
    return ["srun", "--jobid", job, "-J", name, *user_args, "-n", str(len(plan.processes)), "-N", str(len(nodes)),
            "--distribution=arbitrary", "--overcommit", "--label", "--kill-on-bad-exit=0", "--export=ALL",
            "--mpi=none", "--cpu-bind=none", python, "-m", "launcher.on_node.rank_shim", "--rank-from", "SLURM_PROCID",
            "--no-forward"]


def _count_ids(text: str) -> int:
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi) - int(lo) + 1 if hi else 1
    return count


def parse_job_nodes(text: str) -> tuple[list[tuple[str, int]], int]:
    """From ``scontrol show job -d -o``: ``[(node list expression, CPUs on each of its nodes)]`` in
    node order, and the job's CPUs per task."""
    per_task = re.search(r"\bCPUs/Task=(\d+)", text)
    groups = [(nodes, _count_ids(ids)) for nodes, ids in re.findall(r"\bNodes=(\S+) CPU_IDs=([\d,\-]+)", text)]
    return groups, int(per_task.group(1)) if per_task else 1


class SlurmBackend(BatchBackend):
    """Runs the plan as one Slurm job step (``--launcher slurm``); ``launcher`` is srun. Not
    thread-safe, except the methods the handles call (``BatchBackend``)."""

    name = "slurm"
    launcher_name = "srun"

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.job: str | None = None  # the allocation the step runs in
        self.own_job = False  # pslaunch asked for it, so pslaunch cancels it
        self._step: str | None = None
        self._tmp: str | None = None
        self._allocator: LocalHandle | None = None

    # -- before planning -----------------------------------------------------------------------
    @classmethod
    def configure(cls, config, environ):
        refuse_host_flags(config, "slurm", "Slurm")
        refuse_worker_scope(config, "slurm", "Slurm")
        split_args("--slurm-args", config.slurm.args)  # a quoting error shows before anything runs
        job = environ.get("SLURM_JOB_ID")
        if not job:
            return with_hosts(config, [PENDING_HOST])
        require_tools(["scontrol"], "slurm", "slurm-client")
        hosts = job_hosts(job, tool_environ(config))
        slots = sum(h.slots or 0 for h in hosts)
        if config.num_workers > slots:
            raise PlacementError(f"{config.num_workers} workers do not fit the {slots} slots of Slurm allocation {job} "
                                 f"({', '.join(f'{h.name} slots={h.slots}' for h in hosts)}: CPUs / CPUs per task); "
                                 "lower -n or ask salloc / sbatch for more tasks")
        return with_hosts(config, hosts)

    @classmethod
    def dry_run_notes(cls, config):
        count = 1 + config.num_servers + config.num_workers
        name = f"pslaunch-{config.job_id}"
        args = split_args("--slurm-args", config.slurm.args)
        if config.hosts == (PENDING_HOST,):
            return [f"slurm: outside an allocation, pslaunch asks for one: {shlex.join(salloc_argv(count, name, args))}",
                    f"slurm: then places the processes on the nodes Slurm grants as above ({PENDING_HOST.name} "
                    "stands for them; the scheduler goes on the first) and starts them as one srun step"]
        return [f"slurm: allocation {os.environ.get('SLURM_JOB_ID')}: "
                + ", ".join(f"{h.name} slots={h.slots}" for h in config.hosts)
                + f"; one srun step of {count} tasks" + (f" with {shlex.join(args)}" if args else "")]

    # -- the allocation ------------------------------------------------------------------------
    def prepare(self, plan: Plan) -> Plan | None:
        """Check the Slurm tools; outside an allocation ask for one (blocks until Slurm grants it)
        and return the plan for its nodes. Raises ``PlacementError`` when Slurm refuses it or
        leaves it pending for a reason no waiting cures, ``LaunchError`` (124) past ``--timeout``."""
        require_tools(["srun", "scontrol", "scancel", "squeue", "salloc"], "slurm", "slurm-client")
        if plan.processes[0].host != PENDING_HOST:
            self.job = os.environ["SLURM_JOB_ID"]
            return None
        self.job = self._allocate(len(plan.processes))
        return make_plan(with_hosts(self.config, job_hosts(self.job, self.env)))

    def _allocate(self, count: int) -> str:
        args = split_args("--slurm-args", self.config.slurm.args)
        argv = salloc_argv(count, f"pslaunch-{self.config.job_id}", args)
        self._allocator = self.start_tool(argv, self.env)
        lines: queue.Queue[str] = queue.Queue()
        reader = read_lines(self._allocator.popen.stderr, lines.put)
        said: list[str] = []
        granted = False
        reason = None
        start = time.monotonic()
        checked = start
        while True:
            try:
                line = lines.get(timeout=_POLL)
            except queue.Empty:
                line = None
            if line is not None:
                found = _ALLOCATION.search(line)
                if found and self.job is None:
                    self.job, self.own_job = found.group(2), True
                    self.spawner.on_death(["scancel", self.job])
                granted = granted or bool(found and found.group(1) == "Granted")
                if not found and line.strip():
                    said.append(line.removeprefix("salloc: ").strip())
                continue
            if self._allocator.popen.poll() is not None:
                reader.join(5)
                while not lines.empty():
                    said.append(lines.get().removeprefix("salloc: ").strip())
                if self._allocator.popen.returncode == 0 and granted and self.job:
                    return self.job
                raise PlacementError(f"Slurm refused the allocation ({shlex.join(argv)}): "
                                     + ("; ".join(s for s in said if s) or f"salloc exited with {self._allocator.popen.returncode}"))
            now = time.monotonic()
            if self.job and now - checked >= _REASON_EVERY:
                checked = now
                reason = self._pending_reason(reason, said, argv)
            if self.config.timeout is not None and now - start > self.config.timeout:
                raise LaunchError(f"Slurm had not granted job {self.job or '(not yet submitted)'} "
                                  f"after --timeout {self.config.timeout:g} s", exit_code=124)

    def _pending_reason(self, previous: str | None, said: list[str], argv: list[str]) -> str | None:
        res = run_tool(["squeue", "-h", "-j", str(self.job), "-o", "%T %r"], self.env)
        state, _, reason = res.stdout.strip().partition(" ")
        if state != "PENDING":
            return previous
        if reason in ("", "None"):
            reason = "not considered by Slurm's scheduler yet"
        if reason in HOPELESS_REASONS:
            why = f" ({'; '.join(said)})" if said else ""
            raise PlacementError(f"Slurm will not run the allocation pslaunch asked for ({shlex.join(argv)}): "
                                 f"job {self.job} is pending with reason {reason}{why}, which waiting does not cure; "
                                 "ask for fewer tasks (-n, -s) or other --slurm-args")
        if reason != previous:
            self.printer.note(f"waiting for Slurm to grant job {self.job}: {reason}")
        return reason

    # -- the step ------------------------------------------------------------------------------
    def launch(self, plan: Plan) -> list[ProcessHandle]:
        assert self.job is not None, "prepare runs first"
        self._tmp = private_dir(None, "pslaunch-slurm-")
        self.spawner.on_death(["rm", "-rf", "--", self._tmp])
        hostfile = os.path.join(self._tmp, "hostfile")
        with open(hostfile, "w", encoding="utf-8") as fh:
            fh.write("".join(f"{spec.host.name}\n" for spec in plan.processes))
        env = payload(plan.processes, self.config.stop_grace, os.environ.get("PYTHONPATH", ""))
        env.update({"PYTHONPATH": _launcher_root(), "SLURM_HOSTFILE": hostfile})
        step_args = [] if self.own_job else split_args("--slurm-args", self.config.slurm.args)
        argv = srun_argv(self.job, plan, f"pslaunch-{self.config.job_id}", self.config.python, step_args)
        handles = [ShimHandle(spec, self.shim) for spec in plan.processes]
        self.shim.handles = handles
        srun = self.shim.launcher = self.start_tool(argv, child_environ(env))
        done: list[str] = []
        for stream, pipe in (("stdout", srun.popen.stdout), ("stderr", srun.popen.stderr)):
            thread = threading.Thread(target=self._read_labelled, args=(pipe, stream, handles, done),
                                      name=f"pslaunch-srun-{stream}", daemon=True)
            thread.start()
            srun._threads.append(thread)
        return list(handles)

    def _read_labelled(self, pipe, stream: str, handles: list[ShimHandle], done: list[str]) -> None:
        def srun_lines(lines: list[str]) -> None:
            shown = []
            for text in lines:
                if self.shim.stopping and _STOPPED.match(text) and not self.config.verbose:
                    continue  # pslaunch stopped the step itself: the summary says so
                if text.strip():
                    self.shim.last_line = text.strip()
                if self.config.verbose or not _ROUTINE.match(text):
                    shown.append(text)
            if shown:
                self.printer.lines("srun", "srun", "\n".join(shown), stream)

        def emit(block: str) -> None:
            # consecutive lines of one task (or of srun) go on together, as one block
            owner: ShimHandle | None = None
            run: list[str] = []
            for text in block.split("\n"):
                found = _LABEL.match(text)
                task = int(found.group(1)) if found else -1
                target = None
                if found and _SLURMSTEPD.match(found.group(2)):
                    text = found.group(2)  # Slurm's words on the task's stream, not the process's
                elif found and task < len(handles):
                    target, text = handles[task], found.group(2)
                if run and target is not owner:
                    flush(owner, run)
                    run = []
                owner = target
                run.append(text)
            if run:
                flush(owner, run)

        def flush(owner: ShimHandle | None, lines: list[str]) -> None:
            if owner is None:
                srun_lines(lines)
            else:
                route_block(owner, stream, self.printer, "\n".join(lines))

        splitter = LineSplitter(emit)
        try:
            drain(lambda: os.read(pipe.fileno(), READ_SIZE), splitter.feed)
        finally:
            splitter.close()
            with self._lock:
                done.append(stream)
                if len(done) == 2:
                    self.shim.output_done.set()

    # -- signals ---------------------------------------------------------------------------------
    def _step_id(self) -> str | None:
        """``J.S`` of this job's step, from squeue by the step's name; None before Slurm lists it."""
        if self._step is None:
            res = run_tool(["squeue", "-h", "-s", "-j", str(self.job), "-o", "%i %j"], self.env)
            name = f"pslaunch-{self.config.job_id}"
            for line in res.stdout.splitlines():
                step, _, step_name = line.strip().partition(" ")
                if step_name == name:
                    self._step = step
        return self._step

    def _deliver(self, verb: str) -> None:
        """``scancel --signal`` on the step: Slurm signals every process of the step (the process
        tree of each task with proctrack/linuxproc, the step's cgroup with proctrack/cgroup), so
        ``rank_shim`` passes nothing on (``--no-forward``) and Ctrl-Z is SIGSTOP itself."""
        srun = self.shim.launcher
        assert srun is not None
        step = self._step_id()
        if step is None:  # not listed yet: srun itself ends its step (at once); nothing else to reach
            if verb == "KILL":
                srun.kill()
            elif verb == "TERM":
                srun.terminate()
            return
        sig = signal.Signals(GROUP_SIGNALS[verb][0]).name[3:]  # scancel --signal takes TERM, USR1, ...
        run_tool(["scancel", f"--signal={sig}", step], self.env)

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel what pslaunch started in Slurm and wait until squeue no longer lists it."""
        try:
            srun = self.shim.launcher
            if srun is not None and srun.popen.poll() is None:
                self.shim.kill()
                try:
                    srun.popen.wait(5)
                except subprocess.TimeoutExpired:
                    pass  # the spawner kills it below
            target = self.job if self.own_job else self._step
            if target is not None:
                steps = "." in target
                listing = ["squeue", "-h", *(["-s"] if steps else []), "-j", target.partition(".")[0], "-o", "%i"]
                self.cancel_and_wait(lambda: target in run_tool(listing, self.env).stdout.split(),
                                     ["scancel", target], f"Slurm {'step' if steps else 'job'} {target}")
        finally:
            if self._allocator is not None:
                self._allocator.close(0.5)
            if self.shim.launcher is not None:
                self.shim.launcher.close(2.0)
            self.spawner.close()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


def job_hosts(job: str, env: dict[str, str]) -> list[Host]:
    """The nodes of Slurm job ``job`` in order, each with its slots (CPUs / CPUs per task).
    Raises ``SpawnError`` naming the job when Slurm does not show its nodes."""
    res = run_tool(["scontrol", "show", "job", "-d", "-o", job], env)
    groups, per_task = parse_job_nodes(res.stdout)
    if res.returncode != 0 or not groups:
        said = (res.stderr or res.stdout).strip() or f"exit code {res.returncode}"
        raise SpawnError(f"scontrol shows no nodes of Slurm job {job}: {said}")
    hosts: list[Host] = []
    for nodes, cpus in groups:
        names = run_tool(["scontrol", "show", "hostnames", nodes], env).stdout.split()
        hosts += [Host(name, slots=max(1, cpus // per_task)) for name in names]
    return hosts
