"""Node 0 of a job of per-node agents (``pslaunch --nnodes N --node-rank 0``): the backend that
supervises every node's processes as if they were its own.

``prepare`` listens at the rendezvous endpoint and waits (``--rdzv-timeout``) until every other
node's agent has joined (``launcher.backends.agents.hub``). ``launch`` starts node 0's share as children
and tells each agent which of its processes to start for which attempt (the generation:
``launcher.backends.agents.nodes.attempt_specs``); every remote process is an ``AgentHandle`` whose output,
markers and exit the agent reports, and whose signals (stop, Ctrl-Z, end) it passes on. So the
supervisor's rules hold across nodes unchanged: the first real failure anywhere stops every node's
processes and is the root cause; node 0 prints the job's table, serves ``--metrics-port``,
``--timeline`` and the live table for all of it; ``--max-restarts`` starts a new generation on
every node. A node silent for ``--link-timeout``, or whose agent's link ended, is lost: its
processes are unreachable and the job fails naming it (exit 255). An agent's Ctrl-C ends the job
(``interruption``). At the end every agent gets the verdict (``job_ended``) and exits with the
same root cause and exit code.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import replace

import pscontract as ec

from ...config import parse_endpoint
from ...errors import ConfigError, SpawnError
from ...planning.capacity import Capacity
from ...planning.hostfile import Host
from ...planning.network import loopback_name
from ...planning.plan import Plan, ProcessSpec
from ..base import Backend, ExitStatus, Interruption, ProcessHandle, route_block
from ..checks.script import check_scripts_here
from ..local import LocalSpawner
from ..ssh.linkwatch import LinkWatch
from .hub import Hub
from .nodes import attempt_specs, node_config, node_label, node_of, node_slots, share

__all__ = ["AgentsBackend", "AgentHandle", "check_checkpoint_here", "OBSERVED_SETTINGS"]

#: Settings of node 0's processes that follow from options node 0 alone has (the live table,
#: ``--metrics-port``, ``--timeline``): the agents give their processes node 0's values.
OBSERVED_SETTINGS = (ec.PSLAUNCH_STATS, ec.PSLAUNCH_TIMELINE)
#: Seconds node 0 waits for the agents to say they started the processes of an attempt.
_START_WAIT = 30.0


def check_checkpoint_here(directory: str | None, specs) -> None:
    """Raise ``ConfigError`` when a server among ``specs`` would run here and ``directory`` cannot
    be created and written here (each node checks its own before it joins)."""
    if not directory or not any(spec.role == "server" for spec in specs):
        return
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".pslaunch-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"--checkpoint-dir {directory}: this node cannot create or write it: "
                          f"{exc.strerror or exc}") from None


class AgentsCapacity(Capacity):
    """``--nnodes MIN:MAX``: the nodes whose agents are joined now, each with its share of the workers
    (``nodes.node_slots``); read by the supervisor (``launcher.supervision.elastic``)."""

    def __init__(self, backend: "AgentsBackend") -> None:
        self.backend = backend
        self.describe = f"the agents (--nnodes {backend.config.agents.min_nnodes}:{backend.config.agents.nnodes})"

    def read(self) -> list[Host]:
        config = self.backend.config
        present = self.backend.hub.present() if self.backend.hub is not None else list(range(config.agents.min_nnodes))
        return [Host(node_label(rank), slots=node_slots(config)) for rank in present]

    def changed(self) -> bool:
        return True


class AgentHandle(ProcessHandle):
    """A process another node's agent runs for attempt ``generation``."""

    def __init__(self, spec: ProcessSpec, generation: int, backend: "AgentsBackend") -> None:
        super().__init__(spec)
        self.generation = generation
        self.node = node_of(spec)
        self.backend = backend
        self.exit: ExitStatus | None = None  # what the agent reported
        self.answered = False  # the agent said it started the process, or why it could not

    def _poll(self) -> ExitStatus | None:
        if self.exit is not None:
            return self.exit
        why = self.backend.hub.lost(self.node) if self.backend.hub is not None else None
        if why is None:
            return None
        return self._lost(why, self.backend.watch.last_heard(self.node))  # its last sign of life orders failures

    def in_doubt(self) -> bool:
        return self.status is None and self.backend.watch.in_doubt(self.node)

    def signal_process(self, signum: int) -> bool:
        if self.status is not None or self.backend.hub is None:
            return False
        self._tell(f"SIG {signum}")  # its node's agent signals the process alone
        return True

    def _tell(self, what: str) -> None:
        if self.backend.hub is not None:
            self.backend.hub.send(self.node, {"t": "signal", "g": self.generation, "name": self.spec.name,
                                              "what": what})

    def close(self, timeout: float = 2.0) -> None:
        # The agent reports an exit only after the process's output was read to its end and sent
        # before it, so every line is in once the exit is: nothing to wait for.
        return None


class AgentsBackend(Backend):
    """Node 0 of a job of per-node agents (``--nnodes``); see the module docstring. Not thread-safe,
    except ``on_message`` (the hub's reader threads)."""

    name = "agents"
    refuses = {"hostfile": "the nodes are the agents that join at --rdzv-endpoint",
               "sync_dst_dir": "each node runs the code it has; there is no ssh to copy it with",
               "ssh": "the agents use no ssh",
               "scheduler_host": "node 0 runs the scheduler"}

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.spawner = LocalSpawner(config.stop_grace)
        self.watch = LinkWatch(config.link_timeout)
        self.hub: Hub | None = None
        self.base_plan: Plan | None = None
        self._handles: dict[tuple[int, str], AgentHandle] = {}
        self._interrupted: Interruption | None = None
        self._settings: dict[str, str] = {}

    # -- before anything starts ----------------------------------------------------------------------
    @classmethod
    def resolve(cls, config):
        return config  # every node derives the addresses from --rdzv-endpoint (``nodes.node_config``)

    @classmethod
    def configure(cls, config, environ):
        if config.agents.nnodes is None:
            raise ConfigError("--launcher agents is what --nnodes selects: give --nnodes N, --node-rank R and "
                              "--rdzv-endpoint HOST:PORT instead")
        host, _ = parse_endpoint(config.agents.rdzv_endpoint or "")
        if not config.job_key and config.agents.nnodes > 1 and not loopback_name(host):
            raise ConfigError(
                f"--nnodes {config.agents.nnodes} across machines needs the job's key on every node: "
                f"{ec.PSLAUNCH_JOB_KEY_FILE} (a file of 64 hex digits, mode 0600: a mounted Kubernetes Secret, say) or "
                f"{ec.PSLAUNCH_JOB_KEY}; `python3 -c 'import secrets; print(secrets.token_hex(32))'` makes one. "
                f"Without one the agents run only when --rdzv-endpoint is a loopback address")
        return node_config(config)

    @classmethod
    def check_without_starting(cls, config, plan) -> None:
        mine = share(plan, config.agents.node_rank)
        check_scripts_here(list(mine), config.cwd)

    @classmethod
    def dry_run_plan(cls, config, plan: Plan) -> Plan:
        return replace(plan, processes=share(plan, config.agents.node_rank))

    @classmethod
    def dry_run_notes(cls, config):
        host, port = parse_endpoint(config.agents.rdzv_endpoint)
        total = 1 + config.num_servers + config.num_workers
        role = (f"node 0 listens for the other {config.agents.nnodes - 1} node(s) at {host}:{port}" if config.agents.node_rank == 0
                else f"this agent joins node 0 at {host}:{port}")
        return [f"agents: node {config.agents.node_rank} of {config.agents.nnodes}: the processes above are this node's share of the "
                f"job's {total}; {role} (--rdzv-timeout {config.agents.rdzv_timeout:g} s); the scheduler listens at "
                f"{host}:{config.scheduler_port}",
                "agents: placement: the scheduler on node 0, server r and worker r on node r mod N"]

    def prepare(self, plan: Plan) -> None:
        """Check node 0's share (its scripts, its checkpoint directory), then listen and wait for
        every agent (blocks up to ``--rdzv-timeout``). Raises ``ConfigError``, ``RendezvousError``."""
        mine = share(plan, 0)
        check_scripts_here(list(mine), self.config.cwd)
        check_checkpoint_here(self.config.checkpoint_dir, mine)
        self.base_plan = plan
        first = plan.processes[0].env
        self._settings = {name: first[name] for name in OBSERVED_SETTINGS if name in first}
        if not self.config.job_key:
            self.printer.note("no job key (PSLAUNCH_JOB_KEY_FILE): the agents and the job run unauthenticated, "
                              "which pslaunch allows on loopback addresses only")
        key = bytes.fromhex(self.config.job_key) if self.config.job_key else None
        self.hub = Hub(self.config, key, self.printer, self.watch, self.on_message,
                       welcome=lambda: {"observe": self._settings})
        self.hub.listen()
        started = time.monotonic()
        self.hub.wait_for_agents(started + self.config.agents.rdzv_timeout)
        if self.config.verbose:
            self.printer.note(f"{self.config.agents.nnodes} node(s) formed the job in {time.monotonic() - started:.2f} s")
        return None

    def capacity(self) -> Capacity | None:
        if not self.config.agents.min_nnodes:
            return None
        return AgentsCapacity(self)

    # -- attempts ----------------------------------------------------------------------------------
    def launch(self, plan: Plan) -> list[ProcessHandle]:
        assert self.base_plan is not None and self.hub is not None
        generation = int(plan.processes[0].env.get(ec.PSLAUNCH_RESTART_COUNT, "0")) if plan.processes else 0
        planned = {spec.name for spec in self.base_plan.processes}
        # a worker joining the running elastic job (``--nnodes MIN:MAX``) is not in the first plan: its node
        # derives it from its name and place (``nodes.joiner_of``)
        joiners = {spec.name: [spec.local_rank, spec.local_size] for spec in plan.processes if spec.name not in planned}
        specs = attempt_specs(self.base_plan, self.config, generation,
                              [spec.name for spec in plan.processes if spec.name in planned])
        specs += tuple(spec for spec in plan.processes if spec.name in joiners)
        handles: list[ProcessHandle] = []
        remote: dict[int, list[str]] = {}
        try:
            for spec in specs:
                node = node_of(spec)
                if node == 0:
                    handles.append(self.spawner.spawn(spec, self.printer))
                    continue
                why = self.hub.lost(node)
                if why is not None:
                    raise SpawnError(f"cannot start {spec.name}: {node_label(node)} is lost ({why})")
                handle = AgentHandle(spec, generation, self)
                self._handles[(generation, spec.name)] = handle
                handles.append(handle)
                remote.setdefault(node, []).append(spec.name)
            for node, names in remote.items():
                message = {"t": "start", "g": generation, "names": names}
                places = {name: joiners[name] for name in names if name in joiners}
                if places:
                    message["joiners"] = places
                self.hub.send(node, message)
            self._await_starts([h for h in handles if isinstance(h, AgentHandle)])
        except Exception:
            for handle in handles:
                handle.kill()
            raise
        return handles

    def _await_starts(self, handles: list[AgentHandle]) -> None:
        """Wait until each agent said it started its processes (or could not: ``SpawnError``)."""
        assert self.hub is not None
        deadline = time.monotonic() + _START_WAIT
        while True:
            failed = [h for h in handles if h.answered and h.exit is not None and h.pid is None]
            if failed:
                raise SpawnError("; ".join(f"cannot start {h.spec.name}: {h.exit.detail}" for h in failed  # type: ignore[union-attr]
                                           ))
            waiting = [h for h in handles if not h.answered]
            if not waiting:
                return
            for handle in waiting:
                why = self.hub.lost(handle.node)
                if why is not None:
                    raise SpawnError(f"cannot start {handle.spec.name}: {node_label(handle.node)} is lost ({why})")
            if time.monotonic() > deadline:
                raise SpawnError(f"{', '.join(h.spec.name for h in waiting)}: their agents did not say within "
                                 f"{_START_WAIT:g} s that they started them")
            time.sleep(0.02)

    # -- what the agents say (the hub's reader threads) ---------------------------------------------------
    def on_message(self, rank: int, message: dict) -> None:
        kind = message.get("t")
        if kind == "ping":
            return
        if kind == "interrupt":
            signum = message.get("signal")
            if isinstance(signum, int) and self._interrupted is None:
                try:
                    name = signal.Signals(signum).name
                except ValueError:
                    name = f"signal {signum}"
                self._interrupted = Interruption(f"pslaunch on {node_label(rank)} got {name}", 128 + signum)
            return
        handle = self._handles.get((message.get("g"), message.get("name")))  # type: ignore[arg-type]
        if handle is None or handle.node != rank:
            return  # not a process of that node (nor of any attempt): nothing to act on
        if kind == "out":
            text, stream = message.get("text"), message.get("stream")
            if isinstance(text, str) and stream in ("stdout", "stderr"):
                route_block(handle, stream, self.printer, text)
        elif kind == "started":
            pid = message.get("pid")
            handle.pid = pid if isinstance(pid, int) else None
            handle.answered = True
        elif kind == "nostart":
            handle.exit = ExitStatus(code=127, detail=str(message.get("why"))[:500])
            handle.answered = True
        elif kind == "exit":
            code, sig = message.get("code"), message.get("signal")
            if isinstance(sig, int) and not isinstance(sig, bool):
                handle.exit = ExitStatus(signal=sig)
            elif isinstance(code, int) and not isinstance(code, bool):
                handle.exit = ExitStatus(code=code)

    def interruption(self) -> Interruption | None:
        return self._interrupted

    def job_ended(self, exit_code: int, reason: str | None) -> None:
        if reason is not None and reason.startswith("pslaunch got "):  # said on every node: say which
            reason = "pslaunch on node0 got " + reason[len("pslaunch got "):]
        if self.hub is not None:
            self.hub.finish({"t": "verdict", "code": exit_code, "reason": reason})

    def close(self) -> None:
        self.watch.close()
        if self.hub is not None:
            self.hub.close()
        self.spawner.close()
