"""Python's own cost of the 4-element round trip, per side, with no sockets and no other process.

    python -m benchmarks.python_cost [--rounds 4000] [--reps 7]

The round trip's time is mostly waiting: for ZeroMQ's I/O threads, the kernel and the other
processes. This measures what is left, the Python that pslaunch runs per round, by giving the node
an in-process stand-in for the rest of the job as its transport (``psnode`` nodes take a
``Transport`` instance):

* **worker**: a real ``WorkerNode`` behind ``kvcore.create('dist_sync')``; ``kv.push(k, v)`` then
  ``kv.pull(k, out=out)`` of one 4-float key. The stand-in answers the ``PUSH_PULL`` frame at once
  with the ``VALUE`` frame a server would send (and an init and a barrier before that).
* **server**: a real ``ServerNode`` with 2 workers; each round both send the ``PUSH_PULL`` frame
  of their push and pull, the second closes the round, and both replies are sent.

Figures are the best of ``--reps`` batches of ``--rounds`` rounds (the least disturbed), in µs of
one thread's time per round. ``--timeline`` runs both with a timeline (``PSLAUNCH_TIMELINE``, to a
temporary file): its recording and, every 4096 events, its formatting and writing are in the figures. They are hot-cache figures: in a real job every wake-up starts with
cold caches, and the same code then takes two to three times as long (docs/benchmarks.md, "Where
the time goes"). The stand-in's own work is included (a struct pack per reply or message).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import click
import numpy as np

from pscontract import contract_env
from psnode.env import read_env
from psnode.node import protocol
from psnode.node.membership import SCHEDULER, PeerInfo
from psnode.server.node import ServerNode
from psnode.transport.base import Frame, Transport
from psnode.worker.node import WorkerNode

_KEY = 3


_SETTINGS = {"PS_HEARTBEAT_INTERVAL": "0", "PSLAUNCH_SAME_HOST": "tcp"}


def _env(role: str, workers: int):
    return read_env(contract_env(role=role, root_uri="127.0.0.1", root_port=1, num_workers=workers, num_servers=1,
                                 job_id="cost", rank=0, local_rank=0, local_size=1, fixed_rank=False, supervised=False,
                                 settings=_SETTINGS))


def _peer(role: str, rank: int) -> dict:
    return PeerInfo(role, rank, "127.0.0.1", 2000 + rank, f"{role}@127.0.0.1:{2000 + rank}", "-", "-").as_record()


class _StandIn(Transport):
    """The rest of the job, answering in the calling thread: the node's only transport.

    It plays the scheduler (the address book, barriers) and, for a worker, the server (init and the
    small round trip); ``inbox`` is what the node receives next.
    """

    def __init__(self, book: list[dict]) -> None:
        super().__init__(b"")
        self.book = book
        self.inbox: collections.deque = collections.deque()
        self.value = b""
        self.kinds: collections.Counter = collections.Counter()  # messages by command
        self.replies = 0

    def bind(self, port: int = 0, local_name: str | None = None, host: str | None = None) -> int:
        return 1000

    def connect(self, peer: bytes, endpoint: str, watch: bool = False) -> None:
        pass

    def poll(self, timeout: float) -> bool:
        if not self.inbox and timeout > 0:
            time.sleep(min(timeout, 0.0005))  # as a real poll waits: the network thread must not spin
        return bool(self.inbox)

    def wake(self) -> None:
        pass

    def recv(self) -> tuple[bytes, list[Any]]:
        return self.inbox.popleft()

    def close(self, linger: float = 0.0) -> None:
        pass

    @staticmethod
    def same_host_endpoint(local_name: str) -> str:
        return f"standin://{local_name}"

    def _reply(self, peer: bytes, *frames: bytes) -> None:
        self.inbox.append((peer, [Frame(memoryview(f)) for f in frames]))

    def send(self, peer: bytes, frames: Any, track: bool = False, block: bool = True) -> Any:
        cmd, _, req, arg = protocol.unpack_header(frames[0])
        self.kinds[cmd] += 1
        if peer == SCHEDULER:
            if cmd == protocol.Cmd.REGISTER:
                me = protocol.unpack_json(frames[1])
                nodes = self.book + [{**me, "rank": 0}]
                self._reply(SCHEDULER, protocol.pack_header(protocol.Cmd.ADDRBOOK), protocol.pack_json({"rank": 0, "nodes": nodes}))
            elif cmd == protocol.Cmd.BARRIER:
                self._reply(SCHEDULER, protocol.pack_header(protocol.Cmd.BARRIER_DONE, req))
            elif cmd == protocol.Cmd.LEDGER_APPEND:  # worker 0 tells where it placed the key
                self._reply(SCHEDULER, protocol.pack_header(protocol.Cmd.LEDGER_ACK, req))
            elif cmd == protocol.Cmd.HEARTBEAT and len(frames) > 1:  # a timeline's clock probe
                probe = protocol.unpack_json(frames[1]).get("clock")
                self._reply(SCHEDULER, protocol.pack_header(protocol.Cmd.HEARTBEAT_ACK, req),
                            protocol.pack_json({"clock": probe, "now": time.monotonic_ns(), "boot": ""}))
            return None
        self.replies += 1
        if cmd in (protocol.Cmd.PUSH_PULL, protocol.Cmd.PULL):
            self._reply(peer, protocol.pack_value(req, 0, self.value))
        elif cmd == protocol.Cmd.PUSH:  # before the network thread parks, pushes leave on their own
            self._reply(peer, protocol.pack_header(protocol.Cmd.PUSH_ACK, 0, 1), np.array([[req, arg]], np.uint64).tobytes())
        elif cmd == protocol.Cmd.INIT:  # the 4-float value, packed at the start of its first data frame
            self.value = bytes(frames[2])[:16]
            self._reply(peer, protocol.pack_header(protocol.Cmd.INIT_ACK, req, arg))
        elif cmd not in (protocol.Cmd.VALUE, protocol.Cmd.PULL_REPLY):
            raise SystemExit(f"python_cost: the node sent {protocol.Cmd(cmd).name}, not the small round trip's frame")
        return None


def worker_rounds() -> tuple[object, Callable[[int], None]]:
    """A dist_sync store on a real ``WorkerNode`` whose transport is the stand-in, and ``rounds(n)``
    running ``n`` push + pull rounds of one 4-float key (stop it with ``stop_worker``)."""
    from kvcore.stores.distributed import DistKVStore

    stand_in = _StandIn([_peer("server", 0)])
    node = WorkerNode(_env("worker", 1), transport=stand_in).start()  # parks as in a job
    kv = DistKVStore("dist_sync", worker=node)
    value, out = np.ones(4, np.float32), np.zeros(4, np.float32)
    kv.init(_KEY, value)

    def rounds(n: int) -> None:
        for _ in range(n):
            kv.push(_KEY, value)
            kv.pull(_KEY, out=out)
        if out[0] != 1.0:
            raise SystemExit(f"python_cost: pulled {out[0]}, expected 1.0")

    kv.stand_in = stand_in
    return kv, rounds


def stop_worker(kv: object) -> None:
    """Stop the worker of ``worker_rounds``."""
    kv._worker.receiver.stop()


def worker_cost(rounds: int, reps: int) -> float:
    """µs of the calling thread per push + pull round of one 4-float key."""
    kv, run = worker_rounds()
    stand_in = kv.stand_in
    try:
        run(rounds // 2)  # warm up
        best = float("inf")
        stand_in.kinds.clear()
        for _ in range(reps):
            start = time.thread_time()
            run(rounds)
            best = min(best, time.thread_time() - start)
        # a round the OS delays past the network thread's hand-back may go the two-message way
        if stand_in.kinds[protocol.Cmd.PUSH_PULL] < 0.9 * rounds * reps:
            raise SystemExit(f"python_cost: the timed rounds were not the small round trip: {dict(stand_in.kinds)}")
        return best / rounds * 1e6
    finally:
        stop_worker(kv)


def server_rounds() -> tuple[Callable[[], list], Callable[[list], int]]:
    """A real ``ServerNode`` on the stand-in holding one 4-float key: ``messages()`` builds the
    ``PUSH_PULL`` frames of the next round of its 2 workers, ``deliver(messages)`` has the server
    receive and serve them; it returns the replies sent so far."""
    workers = [_peer("worker", 0), _peer("worker", 1)]
    stand_in = _StandIn(workers)
    node = ServerNode(_env("server", 2), transport=stand_in)
    node.register()
    node.store.init(_KEY, _KEY, np.ones(4, np.float32), True, 1)
    payload = np.ones(4, np.float32).tobytes()
    uids = [w["uid"].encode() for w in workers]
    pushes = [0, 0]

    def messages() -> list:
        out = []
        for rank in (0, 1):
            pushes[rank] += 1
            req = 2 * pushes[rank]
            out.append((uids[rank], [Frame(memoryview(protocol.pack_push_pull(req + 1, req, _KEY, 0, pushes[rank], payload)))]))
        return out

    def deliver(batch: list) -> int:
        for message in batch:
            stand_in.inbox.append(message)
            node.conn.process(0)
        return stand_in.replies

    return messages, deliver


def server_cost(rounds: int, reps: int) -> float:
    """µs of the server's thread per round: 2 workers' PUSH_PULL frames in, 2 VALUE frames out."""
    messages, deliver = server_rounds()
    for _ in range(rounds // 2):
        deliver(messages())
    best = float("inf")
    for _ in range(reps):
        before = deliver(messages())
        start = time.thread_time()
        for _ in range(rounds):
            replies = deliver(messages())
        best = min(best, time.thread_time() - start)
        if replies - before != 2 * rounds:
            raise SystemExit(f"python_cost: the server sent {replies - before} replies for {rounds} rounds of 2 workers")
    return best / rounds * 1e6


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--rounds", type=click.IntRange(100), default=4000, show_default=True, help="Rounds per batch.")
@click.option("--reps", type=click.IntRange(1), default=7, show_default=True, help="Batches; the best counts.")
@click.option("--timeline", is_flag=True, help="With a timeline (PSLAUNCH_TIMELINE) on both sides.")
def main(rounds: int, reps: int, timeline: bool) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if timeline:
            _SETTINGS["PSLAUNCH_TIMELINE"] = f"{tmp}/timeline.json"
        worker = worker_cost(rounds, reps)
        server = server_cost(rounds, reps)
    click.echo(f"worker: {worker:.1f} µs of the calling thread per push + pull round (4-element key)")
    click.echo(f"server: {server:.1f} µs per round of 2 workers (2 PUSH_PULL frames in, 2 VALUE frames out)")


if __name__ == "__main__":
    main()
