"""Node 0's side of the rendezvous: listen at ``--rdzv-endpoint``, admit the agents, keep their links.

``Hub.listen`` binds the endpoint; a thread accepts connections and runs each one's handshake
(``launcher.backends.agents.wire``) in a thread of its own, at most ``MAX_PENDING`` at once and each within
``HANDSHAKE_TIMEOUT`` seconds, so a stranger that connects and says nothing holds no slot for
long. An agent is admitted once it proved the key and its command agrees with node 0's; then a
reader thread hands each of its messages to ``on_message(rank, message)``. Every refusal is named
on both sides: the agent exits with the reason, node 0 notes it (the first ``_NOTED_REFUSALS``) and
names it again if the node it expected never came (``wait_for_agents``).

Until the job has formed, an agent whose link drops leaves the roster (its node may start again:
a pod restarted); once it formed, a new agent for a rank is refused (this attempt's processes are
placed), and a dropped link is that node's loss (``lost``), as is ``--link-timeout`` of silence
(``launcher.backends.ssh.linkwatch.LinkWatch``, which also pings every agent). With ``--nnodes
MIN:MAX`` the job forms with nodes 0..MIN-1, and nodes MIN..MAX-1 may join at any time and leave
(``present``): their workers join and leave the running job.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ...config import LaunchConfig, parse_endpoint
from ...errors import PreflightError
from ...observe.output import Printer
from ..ssh.linkwatch import LinkWatch
from .nodes import command_fields, differences, node_label
from .wire import PROTOCOL, Channel, LinkClosed, WireError, new_nonce, proof, session_key

__all__ = ["Hub", "AgentLink", "RendezvousError", "HANDSHAKE_TIMEOUT", "MAX_PENDING"]

#: Seconds a connection has to complete the handshake.
HANDSHAKE_TIMEOUT = 10.0
#: Handshakes in progress at once; more connections are closed at once.
MAX_PENDING = 32
_NOTED_REFUSALS = 20
_TICK = 0.05


class RendezvousError(PreflightError):
    """The agents did not form the job (exit code 3): a node missing at ``--rdzv-timeout``, or an
    agent refused."""


@dataclass
class AgentLink:
    """Node 0's view of one admitted agent."""

    rank: int
    channel: Channel
    address: str
    joined_at: float
    closed: str | None = None  # why the link ended, once it did
    reader: threading.Thread | None = field(default=None, repr=False)


class Hub:
    """The agents of one job, as node 0 holds them. Thread-safe."""

    def __init__(self, config: LaunchConfig, key: bytes | None, printer: Printer, watch: LinkWatch,
                 on_message: Callable[[int, dict], None], welcome: Callable[[], dict] | None = None) -> None:
        assert config.agents.nnodes is not None and config.agents.rdzv_endpoint is not None
        self.config = config
        self.key = key or b""
        self.keyed = key is not None
        self.printer = printer
        self.watch = watch
        self.on_message = on_message
        self._welcome = welcome or dict
        self.host, self.port = parse_endpoint(config.agents.rdzv_endpoint)
        # the agents that form the job: every other node, or with --nnodes MIN:MAX the first MIN-1 (the
        # nodes MIN..MAX-1 may join and leave while the job runs: ``present``)
        self.expected = (config.agents.min_nnodes or config.agents.nnodes) - 1
        self.elastic = bool(config.agents.min_nnodes)
        self.links: dict[int, AgentLink] = {}
        self.refusals: list[str] = []
        self.formed = False
        self._mine = command_fields(config)
        self._lock = threading.Lock()
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._acceptor: threading.Thread | None = None

    # -- listening -----------------------------------------------------------------------------
    def listen(self) -> None:
        """Bind the rendezvous endpoint (the host's own address when it is one of this machine's,
        else every interface) and start accepting. Raises ``PreflightError`` naming the endpoint."""
        last: OSError | None = None
        for address in (self.host, "0.0.0.0"):
            try:
                infos = socket.getaddrinfo(address, self.port, type=socket.SOCK_STREAM)
                family, _, _, _, where = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(where)
                sock.listen(64)
            except OSError as exc:
                last = exc
                continue
            self._listener = sock
            break
        if self._listener is None:
            assert last is not None
            raise PreflightError(f"node 0 cannot listen at --rdzv-endpoint {self.config.agents.rdzv_endpoint}: "
                                 f"{last.strerror or last}")
        self._acceptor = threading.Thread(target=self._accept_loop, name="pslaunch-rdzv-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        self._listener.settimeout(0.5)
        while not self._stopping.is_set():
            try:
                sock, where = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            address = where[0]
            if not self._pending.acquire(blocking=False):
                self._refused(address, None, f"{MAX_PENDING} handshakes were already in progress")
                sock.close()
                continue
            threading.Thread(target=self._admit_then_release, args=(sock, address), daemon=True,
                             name=f"pslaunch-rdzv-{address}").start()

    def _admit_then_release(self, sock: socket.socket, address: str) -> None:
        try:
            self._admit(sock, address)
        finally:
            self._pending.release()

    # -- the handshake, node 0's side ----------------------------------------------------------------
    def _admit(self, sock: socket.socket, address: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = Channel(sock, f"the agent at {address}", "to-agent")
        rank: int | None = None

        def refuse(why: str) -> None:
            self._refused(address, rank, why)
            try:
                channel.send({"t": "refused", "why": why})
            except WireError:
                pass
            channel.close()

        try:
            hello = channel.receive(HANDSHAKE_TIMEOUT)
            fields = _hello_fields(hello)
            if isinstance(fields, str):
                return refuse(fields)
            version, job, rank, agent_nonce, keyed = fields
            if version != PROTOCOL:
                return refuse(f"it speaks protocol {version}, node 0 speaks {PROTOCOL} (another pslaunch version)")
            if job != self.config.job_id:
                return refuse(f"it belongs to job {job!r}, node 0 runs job {self.config.job_id!r} (another job's agent, "
                              "or a different --rdzv-endpoint or --job-id)")
            if keyed != self.keyed:
                return refuse("node 0 holds a job key and the agent none (set PSLAUNCH_JOB_KEY_FILE on every node)"
                              if self.keyed else "the agent holds a job key and node 0 none (give every node the key)")
            node0_nonce = new_nonce()
            channel.send({"t": "challenge", "nonce": node0_nonce,
                          "proof": proof(self.key, "node0", agent_nonce, node0_nonce, job)})
            answer = channel.receive(HANDSHAKE_TIMEOUT)
            expected = proof(self.key, "agent", agent_nonce, node0_nonce, job, str(rank))
            if answer.get("t") != "proof" or not isinstance(answer.get("proof"), str) \
                    or not _same(answer["proof"], expected):
                return refuse("wrong job key: its proof does not match node 0's key")
            channel.secure(session_key(self.key, agent_nonce, node0_nonce))
            # Authenticated from here on: the rest may name node 0's options.
            if not 1 <= rank < (self.config.agents.nnodes or 1):
                return refuse(f"node rank {rank} is not an agent's rank of --nnodes {self.config.agents.nnodes} "
                              f"(1..{(self.config.agents.nnodes or 1) - 1}; node 0 is this one)")
            diffs = differences(self._mine, hello.get("command"), rank)
            if diffs:
                return refuse(f"its command differs from node 0's: {'; '.join(diffs)}")
            with self._lock:
                taken = self.links.get(rank)
                if taken is not None and taken.closed is None:
                    return refuse(f"{node_label(rank)} already joined from {taken.address}")
                if self.formed and not (self.elastic and rank > self.expected):
                    return refuse(f"the job has formed without it ({node_label(rank)} left it); a node cannot join "
                                  "an attempt that is placed" + (f" (--nnodes {self.config.agents.min_nnodes}:"
                                  f"{self.config.agents.nnodes}: nodes {self.expected + 1}.. may)" if self.elastic else ""))
                link = AgentLink(rank, channel, address, time.monotonic())
                self.links[rank] = link
            channel.send({"t": "welcome", **self._welcome()})
        except socket.timeout:
            return refuse(f"no handshake within {HANDSHAKE_TIMEOUT:g} s")
        except (WireError, OSError) as exc:
            if not isinstance(exc, LinkClosed):
                self._refused(address, rank, str(exc))
            channel.close()
            return None
        self.watch.add(rank, self._pinger(link))
        self.watch.heard(rank)  # an elastic node joining again: its silence before does not count
        link.reader = threading.Thread(target=self._read, args=(link,), daemon=True, name=f"pslaunch-agent-{rank}")
        link.reader.start()
        if self.config.verbose:
            self.printer.note(f"{node_label(rank)} joined from {address}")
        return None

    def _refused(self, address: str, rank: int | None, why: str) -> None:
        who = f"an agent at {address}" + (f" (node rank {rank})" if rank is not None else "")
        text = f"refused {who}: {why}"
        with self._lock:
            self.refusals.append(text)
            count = len(self.refusals)
        if count <= _NOTED_REFUSALS:
            self.printer.note(text)
        elif count == _NOTED_REFUSALS + 1:
            self.printer.note("refusing more agents; not naming each any more")

    def _pinger(self, link: AgentLink) -> Callable[[bytes], None]:
        def ping(_: bytes) -> None:
            if link.closed is None:
                try:
                    link.channel.send({"t": "ping"})
                except WireError:
                    pass
        return ping

    def _read(self, link: AgentLink) -> None:
        while True:
            try:
                message = link.channel.receive()
            except WireError as exc:
                with self._lock:
                    link.closed = ("its agent's connection ended" if isinstance(exc, LinkClosed)
                                   else f"its agent's link was dropped: {exc}")
                    if (not self.formed or (self.elastic and link.rank > self.expected)) \
                            and self.links.get(link.rank) is link:
                        del self.links[link.rank]  # it may join again while the job forms (or an elastic node, later)
                link.channel.close()
                return
            self.watch.heard(link.rank)
            self.on_message(link.rank, message)

    # -- the job ------------------------------------------------------------------------------------
    def wait_for_agents(self, deadline: float, noted_after: float = 3.0) -> None:
        """Block until every agent joined (then the job has formed), or raise ``RendezvousError``
        at ``deadline`` (``time.monotonic``) naming the nodes missing and the refusals."""
        start = time.monotonic()
        noted = False
        while True:
            with self._lock:
                joined = sorted(r for r, link in self.links.items() if link.closed is None and r <= self.expected)
                if len(joined) == self.expected:
                    self.formed = True
                    return
            now = time.monotonic()
            missing = [node_label(r) for r in range(1, self.expected + 1) if r not in joined]
            if not noted and now - start > noted_after:
                noted = True
                self.printer.note(f"waiting for {', '.join(missing)} to join at {self.config.agents.rdzv_endpoint} "
                                  f"(--rdzv-timeout {self.config.agents.rdzv_timeout:g} s)")
            if now > deadline:
                refused = f"; refused meanwhile: {'; '.join(self.refusals[-3:])}" if self.refusals else ""
                raise RendezvousError(f"{', '.join(missing)} did not join node 0 at {self.config.agents.rdzv_endpoint} within "
                                      f"--rdzv-timeout {self.config.agents.rdzv_timeout:g} s{refused}")
            time.sleep(_TICK)

    def present(self) -> list[int]:
        """The ranks of the nodes whose agents are joined now (node 0 too)."""
        with self._lock:
            return [0] + sorted(r for r, link in self.links.items() if link.closed is None and not self.watch.lost(r))

    def send(self, rank: int, message: dict) -> bool:
        """Send ``message`` to node ``rank``'s agent; False when its link is gone."""
        link = self.links.get(rank)
        if link is None or link.closed is not None:
            return False
        try:
            link.channel.send(message)
        except WireError:
            return False
        return True

    def lost(self, rank: int) -> str | None:
        """Why node ``rank`` is lost (its link ended, or was silent for ``--link-timeout``), else None."""
        link = self.links.get(rank)
        if link is None:
            return f"{node_label(rank)} never joined"
        if link.closed is not None:
            return link.closed
        if self.watch.lost(rank):
            return f"no answer for {self.watch.timeout:g} s"
        return None

    def finish(self, message: dict, wait: float = 5.0) -> None:
        """Send ``message`` (the verdict) to every agent and wait up to ``wait`` seconds for each to
        close its link: an agent reads the verdict before node 0's end could reset the connection."""
        for rank in list(self.links):
            self.send(rank, message)
        deadline = time.monotonic() + wait
        # a lost node's agent cannot answer: its own link timeout ends it
        while time.monotonic() < deadline and any(link.closed is None and not self.watch.lost(rank)
                                                  for rank, link in self.links.items()):
            time.sleep(_TICK)

    def close(self) -> None:
        """Stop accepting and close every link. Idempotent."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        for link in list(self.links.values()):
            link.channel.close()
        if self._acceptor is not None:
            self._acceptor.join(2)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _hello_fields(hello: dict) -> tuple[int, str, int, str, bool] | str:
    """The fields of a ``hello``, or why it is malformed."""
    if hello.get("t") != "hello":
        return f"its first message was {str(hello.get('t'))[:40]!r}, not hello"
    version, job, rank, nonce, keyed = (hello.get(k) for k in ("v", "job", "node", "nonce", "keyed"))
    if not isinstance(version, int) or not isinstance(job, str) or not isinstance(rank, int) or isinstance(rank, bool) \
            or not isinstance(nonce, str) or len(nonce) != 32 or not isinstance(keyed, bool):
        return "its hello is malformed"
    return version, job[:200], rank, nonce, keyed
