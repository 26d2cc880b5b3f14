"""A per-node agent (``pslaunch --nnodes N --node-rank R``, R > 0): join node 0, run this node's share.

The agent checks its share first (its scripts, its checkpoint directory), then connects to node 0
at ``--rdzv-endpoint``, again and again until ``--rdzv-timeout`` (node 0 may start later, or its
name not resolve yet), and proves it holds the job key (``launcher.backends.agents.wire``). From then on it
does what node 0 says and reports what happens:

* ``start``: start these processes of this attempt (generation) as children here, in their own
  process groups under the watchdog (``launcher.backends.local.LocalSpawner``); their lines show
  here with the usual prefixes and travel to node 0 with their markers; each exit is reported
  once its output is all sent;
* ``signal``: TERM, KILL, STOP, CONT or END for one process (node 0's teardown, Ctrl-Z, the end), or
  ``SIG N`` for one of the runtime's own signals to the process alone (its stack, a preemption);
* ``verdict``: the job is over: the agent says node 0's root cause and exits with its exit code.

In an elastic job whose nodes come and go (``--nnodes MIN:MAX``, a node rank MIN or above) a start may
name a worker that joins the running job (``nodes.joiner_of``), and SIGTERM to the agent makes this
node's workers leave at their next step boundary; it exits 0 once they did, and the job goes on.
Otherwise it never decides the job's fate alone but in two cases, where it stops every process here first:
node 0 lost (its link ended, or silent for ``--link-timeout``: exit 255 naming node 0), and a second
Ctrl-C (the first one asks node 0 to end the whole job: ``interrupt``).
"""

from __future__ import annotations

import hmac
import queue
import signal
import socket
import threading
import time
from dataclasses import replace
from typing import Callable

from pscontract import MARKER, preempt_signal, stack_signal

from ..backends.agents.backend import check_checkpoint_here
from ..backends.agents.hub import RendezvousError
from ..backends.agents.nodes import attempt_specs, command_fields, joiner_of, node_label, node_of, share
from ..backends.agents.wire import PROTOCOL, Channel, LinkClosed, Refused, WireError, new_nonce, proof, session_key
from ..backends.base import ProcessHandle
from ..backends.checks.script import check_scripts_here
from ..backends.local import LocalSpawner
from ..config import LaunchConfig, parse_endpoint
from ..errors import SpawnError
from ..observe.output import Printer
from ..on_node.process_groups import VERBS, stop
from ..planning.plan import Plan
from .result import result_of
from .verdict import Failure

__all__ = ["NodeAgent", "join", "run_agent", "EXIT_NODE0_LOST"]

#: An agent's exit code when it lost node 0 (as pslaunch's for a lost host).
EXIT_NODE0_LOST = 255
_RETRY = 0.2  # between tries to reach node 0: a connection refused costs nothing
_TICK = 0.05
_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: ``SIG N`` messages node 0 may send: only the runtime's own signals (``stack_signal``, ``preempt_signal``)
_RUNTIME_SIGNALS = {f"SIG {n}": n for n in (stack_signal(), preempt_signal())}
#: ... and in an elastic job SIGTERM to a worker alone: the notice to leave at its next step boundary
_LEAVE = f"SIG {int(signal.SIGTERM)}"


def join(config: LaunchConfig, key: bytes | None, deadline: float, note: Callable[[str], None],
         connect: Callable[..., socket.socket] = socket.create_connection) -> tuple[Channel, dict]:
    """Connect to node 0 and pass the handshake, retrying until ``deadline`` (``time.monotonic``);
    returns the secured channel and node 0's welcome.

    Raises ``RendezvousError``: node 0 refused this agent (wrong key, another job, a different
    command), did not prove the key, or was not reached by the deadline (naming the last error)."""
    host, port = parse_endpoint(config.agents.rdzv_endpoint or "")
    where = f"node 0 at {config.agents.rdzv_endpoint}"
    last = "no attempt"
    noted = False
    start = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"{where} was not reached within --rdzv-timeout {config.agents.rdzv_timeout:g} s "
                                  f"(last try: {last})")
        try:
            sock = connect((host, port), timeout=min(5.0, left))
        except OSError as exc:
            last = exc.strerror or str(exc)
        else:
            try:
                return _handshake(Channel(sock, where, "to-node0"), config, key)
            except Refused as exc:
                raise RendezvousError(str(exc)) from None
            except (WireError, OSError) as exc:
                last = str(exc)
                sock.close()
        if not noted and time.monotonic() - start > 3.0:
            noted = True
            note(f"waiting for {where} (--rdzv-timeout {config.agents.rdzv_timeout:g} s; last try: {last})")
        time.sleep(min(_RETRY, max(0.0, deadline - time.monotonic())))


def _handshake(channel: Channel, config: LaunchConfig, key: bytes | None) -> tuple[Channel, dict]:
    """The agent's side of the handshake (``launcher.backends.agents.wire``): the secured channel and node
    0's welcome. Raises ``Refused``, ``WireError``, ``OSError`` (``socket.timeout``)."""
    secret = key or b""
    nonce = new_nonce()
    channel.send({"t": "hello", "v": PROTOCOL, "job": config.job_id, "node": config.agents.node_rank, "nonce": nonce,
                  "keyed": key is not None, "command": command_fields(config)})
    answer = channel.receive(15.0)
    if answer.get("t") == "refused":
        raise Refused(f"node 0 at {config.agents.rdzv_endpoint} refused this agent: {str(answer.get('why'))[:500]}")
    node0_nonce = answer.get("nonce")
    if answer.get("t") != "challenge" or not isinstance(node0_nonce, str) or not isinstance(answer.get("proof"), str):
        raise WireError(f"node 0 at {config.agents.rdzv_endpoint} answered the hello with {str(answer.get('t'))[:40]!r}")
    expected = proof(secret, "node0", nonce, node0_nonce, config.job_id)
    own = proof(secret, "agent", nonce, node0_nonce, config.job_id, str(config.agents.node_rank))
    channel.send({"t": "proof", "proof": own})  # also when node 0's is wrong: so that node 0 names the refusal
    if not hmac.compare_digest(expected.encode(), answer["proof"].encode()):
        channel.close()
        raise Refused(f"node 0 at {config.agents.rdzv_endpoint} does not hold this agent's job key (its proof does not match "
                      "PSLAUNCH_JOB_KEY_FILE / PSLAUNCH_JOB_KEY here): every node needs the same key")
    channel.secure(session_key(secret, nonce, node0_nonce))
    welcome = channel.receive(15.0)
    if welcome.get("t") == "refused":
        channel.close()
        raise Refused(f"node 0 at {config.agents.rdzv_endpoint} refused this agent: {str(welcome.get('why'))[:500]}")
    if welcome.get("t") != "welcome":
        raise WireError(f"node 0 at {config.agents.rdzv_endpoint} answered the proof with {str(welcome.get('t'))[:40]!r}")
    return channel, welcome


class _Forwarder:
    """The printer one process's output readers write to (``launcher.backends.base.route_block``):
    lines show here and go to node 0; marker lines go to node 0 only."""

    def __init__(self, printer: Printer, channel: Channel, generation: int, name: str) -> None:
        self.printer = printer
        self.channel = channel
        self.generation = generation
        self.name = name
        self.observer = self._marker

    def _send(self, stream: str, text: str) -> None:
        try:
            self.channel.send({"t": "out", "g": self.generation, "name": self.name, "stream": stream, "text": text})
        except WireError:
            pass  # node 0 is gone: the main loop sees it and stops everything here

    def lines(self, name: str, role: str, block: str, stream: str = "stdout") -> None:
        self.printer.lines(name, role, block, stream)
        self._send(stream, block)

    def _marker(self, handle: ProcessHandle, control: str) -> bool:
        self._send("stderr", MARKER + control)
        return False  # the local handle learns it too (READY, FAILED)


class NodeAgent:
    """Runs node ``config.agents.node_rank``'s share of ``plan`` for node 0; ``run`` blocks until the job
    is over and returns the exit code. Use from the main thread (it installs signal handlers)."""

    def __init__(self, config: LaunchConfig, plan: Plan, printer: Printer) -> None:
        self.config = config
        self.plan = plan
        self.printer = printer
        self.key = bytes.fromhex(config.job_key) if config.job_key else None
        self.spawner = LocalSpawner(config.stop_grace)
        self.channel: Channel | None = None
        self.handles: dict[tuple[int, str], ProcessHandle] = {}
        self.reported: set[tuple[int, str]] = set()
        self.generation = 0
        self.failure: Failure | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._heard = time.monotonic()
        self._signals: list[int] = []
        self._observe: dict[str, str] = {}
        self._stop = threading.Event()

    def run(self) -> int:
        mine = share(self.plan, self.config.agents.node_rank)
        check_scripts_here(list(mine), self.config.cwd)
        check_checkpoint_here(self.config.checkpoint_dir, mine)
        old = {sig: signal.signal(sig, self._on_signal) for sig in _STOPPING}
        try:
            deadline = time.monotonic() + self.config.agents.rdzv_timeout
            self.channel, welcome = join(self.config, self.key, deadline, self.printer.note)
            observe = welcome.get("observe")
            if isinstance(observe, dict):
                self._observe = {k: str(v) for k, v in observe.items() if k in ("PSLAUNCH_STATS", "PSLAUNCH_TIMELINE")}
            if self.config.verbose:
                self.printer.note(f"{node_label(self.config.agents.node_rank)} joined node 0 at {self.config.agents.rdzv_endpoint}")
            threading.Thread(target=self._read, name="pslaunch-agent-read", daemon=True).start()
            threading.Thread(target=self._ping, name="pslaunch-agent-ping", daemon=True).start()
            code, reason = self._serve()
        finally:
            self._stop.set()
            self._stop_all()
            self.spawner.close()
            if self.channel is not None:
                self.channel.close()
            for sig, handler in old.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        self.failure = None if code == 0 else Failure(reason or "the job failed", code)
        if code != 0:
            self.printer.note(f"root cause: {reason}")
            self.printer.note(f"exit code {code}")
        elif self.config.verbose:
            self.printer.note("the job succeeded")
        self.printer.flush()
        return code

    # -- threads ------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)

    def _read(self) -> None:
        assert self.channel is not None
        while True:
            try:
                message = self.channel.receive()
            except WireError as exc:
                self._inbox.put({"t": "closed", "why": str(exc) if not isinstance(exc, LinkClosed)
                                 else "node 0 closed the connection"})
                return
            self._heard = time.monotonic()
            self._inbox.put(message)

    def _ping(self) -> None:
        interval = max(0.2, min(2.0, self.config.link_timeout / 5)) if self.config.link_timeout > 0 else 2.0
        while not self._stop.wait(interval):
            try:
                assert self.channel is not None
                self.channel.send({"t": "ping"})
            except WireError:
                return

    def _send(self, message: dict) -> None:
        try:
            assert self.channel is not None
            self.channel.send(message)
        except WireError:
            pass  # the reader sees the end of the link

    # -- the loop ---------------------------------------------------------------------------------------
    def _serve(self) -> tuple[int, str | None]:
        """Do what node 0 says until its verdict; returns ``(exit code, root cause)``."""
        asked: int | None = None  # the signal whose end of the job node 0 was asked for
        leaving = False  # a node of an elastic job that got SIGTERM: its workers leave
        asked_at = 0.0
        looked = time.monotonic()
        while True:
            now = time.monotonic()
            if now - looked > self.config.link_timeout / 2 > 0:  # this process did not run (stopped): no silence
                self._heard += now - looked
            looked = now
            if self._signals and self._leaves_alone(self._signals[-1]):
                if not leaving:  # a drained node of an elastic job: its workers leave, the job goes on
                    leaving = True
                    self.printer.note(f"got SIGTERM: {node_label(self.config.agents.node_rank)} leaves the elastic job; "
                                      "its workers leave at their next step boundary")
                    for handle in self.handles.values():
                        if handle.poll() is None and handle.spec.role == "worker":
                            handle.signal_process(signal.SIGTERM)
                if len(self._signals) > 1:
                    return 128 + self._signals[-1], f"pslaunch on {node_label(self.config.agents.node_rank)} got a " \
                                                    "second signal while its workers left the job"
                self._report_exits()
                if all(ident in self.reported for ident in self.handles):
                    return 0, None
            elif self._signals:
                signum = self._signals[-1]
                if asked is None:
                    asked, asked_at = signum, now
                    self.printer.note(f"got {signal.Signals(signum).name}: asking node 0 to end the whole job")
                    self._send({"t": "interrupt", "signal": signum})
                elif len(self._signals) > 1 or now - asked_at > self.config.stop_grace + 10:
                    return 128 + signum, f"pslaunch on {node_label(self.config.agents.node_rank)} got " \
                                         f"{signal.Signals(signum).name} and node 0 did not end the job"
            try:
                message = self._inbox.get(timeout=_TICK)
            except queue.Empty:
                message = None
            if message is not None:
                kind = message.get("t")
                if kind == "verdict":
                    code = message.get("code")
                    reason = message.get("reason")
                    return (code if isinstance(code, int) else 1), (str(reason) if reason is not None else None)
                if kind == "closed":
                    return EXIT_NODE0_LOST, self._lost(str(message.get("why")))
                if kind == "start":
                    self._start(message)
                elif kind == "signal":
                    self._signal(message)
            if self.config.link_timeout > 0 and time.monotonic() - self._heard > self.config.link_timeout:
                return EXIT_NODE0_LOST, self._lost(f"no word for {self.config.link_timeout:g} s")
            self._report_exits()

    def _leaves_alone(self, signum: int) -> bool:
        """SIGTERM to the agent of a node that may leave the running job (``--nnodes MIN:MAX``, a rank
        MIN or above: a Kubernetes pod deleted, a node drained): its workers leave, the job goes on."""
        agents = self.config.agents
        return signum == signal.SIGTERM and bool(agents.min_nnodes) and agents.node_rank >= agents.min_nnodes

    def _lost(self, why: str) -> str:
        return f"lost node 0 at {self.config.agents.rdzv_endpoint} ({why}); stopped {node_label(self.config.agents.node_rank)}'s processes"

    def _start(self, message: dict) -> None:
        generation, names = message.get("g"), message.get("names")
        if not isinstance(generation, int) or not isinstance(names, list) or generation < self.generation:
            return  # an order of an attempt that is over
        self.generation = generation
        assert self.channel is not None
        joiners = message.get("joiners") if isinstance(message.get("joiners"), dict) else {}
        for name in names:
            try:
                if name in joiners:  # a worker that joins the running elastic job here (--nnodes MIN:MAX)
                    spec = joiner_of(self.plan, self.config, name, joiners[name])
                    if node_of(spec) != self.config.agents.node_rank:
                        raise ValueError(f"{name} is not placed on {node_label(self.config.agents.node_rank)}")
                else:
                    (spec,) = attempt_specs(self.plan, self.config, generation, [str(name)])
            except KeyError:
                self._send({"t": "nostart", "g": generation, "name": name, "why": f"this node's plan has no {name}"})
                continue
            except ValueError as exc:
                self._send({"t": "nostart", "g": generation, "name": name, "why": str(exc)})
                continue
            if self._observe:
                spec = replace(spec, env={**spec.env, **self._observe})
            self.printer.starting([spec.name])
            try:
                handle = self.spawner.spawn(spec, _Forwarder(self.printer, self.channel, generation, spec.name))
            except SpawnError as exc:
                self._send({"t": "nostart", "g": generation, "name": spec.name, "why": str(exc)})
                continue
            self.handles[(generation, spec.name)] = handle
            self._send({"t": "started", "g": generation, "name": spec.name, "pid": handle.pid})

    def _signal(self, message: dict) -> None:
        handle = self.handles.get((message.get("g"), message.get("name")))  # type: ignore[arg-type]
        what = message.get("what")
        if handle is not None and what in VERBS:  # from node 0, checked: anything else is dropped
            handle.tell(what)
        elif handle is not None and what in _RUNTIME_SIGNALS:  # the runtime's own: its stack, a preemption
            handle.signal_process(_RUNTIME_SIGNALS[what])
        elif handle is not None and what == _LEAVE and self.config.elastic:  # an elastic job's worker: leave
            handle.signal_process(signal.SIGTERM)

    def _report_exits(self) -> None:
        for ident, handle in self.handles.items():
            if ident in self.reported:
                continue
            status = handle.poll()
            if status is None:
                continue
            self.reported.add(ident)
            handle.close(2.0)  # every line read and sent before the exit
            self._send({"t": "exit", "g": ident[0], "name": ident[1], "code": status.code, "signal": status.signal})

    def _stop_all(self) -> None:
        """TERM (and CONT) what still runs here, the grace period, then KILL (``process_groups.stop``)."""
        running = [h for h in self.handles.values() if h.poll() is None]
        stop(running, terminate=lambda h: h.terminate(), kill=lambda h: h.kill(), alive=lambda h: h.poll() is None,
             grace=self.config.stop_grace, tick=_TICK)
        for handle in self.handles.values():
            handle.close(1.0)


def run_agent(config: LaunchConfig, plan: Plan, printer: Printer):
    """Run this node's agent; its ``RunResult`` (the rows of this node's processes)."""
    agent = NodeAgent(config, plan, printer)
    agent.run()
    handles = list(agent.handles.values())
    return result_of(handles, {id(h): "" for h in handles}, agent.failure, printer.last_lines, ())

