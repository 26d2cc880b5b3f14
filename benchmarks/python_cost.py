"""Python's own cost of the 4-element round trip, per side, with no sockets and no other process.

    python benchmarks/python_cost.py [--rounds 4000] [--reps 7]

The round trip's time is mostly waiting: for ZeroMQ's I/O threads, the kernel and the other
processes. This measures what is left, the Python that pslaunch runs per round, by putting an
in-process stand-in where the transport would be:

* **worker**: a real ``WorkerNode`` behind ``kvcore.create('dist_sync')``; ``kv.push(k, v)`` then
  ``kv.pull(k, out=out)`` of one 4-float key. The stand-in answers the ``PUSH_PULL`` frame at once
  with the ``VALUE`` frame a server would send (and an init and a barrier before that).
* **server**: a real ``ServerNode`` with 2 workers; each round both send the ``PUSH_PULL`` frame
  of their push and pull, the second closes the round, and both replies are sent.

Figures are the best of ``--reps`` batches of ``--rounds`` rounds (the least disturbed), in µs of
one thread's time per round. They are hot-cache figures: in a real job every wake-up starts with
cold caches, and the same code then takes two to three times as long (docs/benchmarks.md, "Where
the time goes"). The stand-in's own work is included (a struct pack per reply or message).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from psnode import protocol  # noqa: E402
from psnode.env import read_env  # noqa: E402
from psnode.node import SCHEDULER, PeerInfo  # noqa: E402
from psnode.server import ServerNode  # noqa: E402
from psnode.worker import WorkerNode  # noqa: E402

_CONTRACT = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1", "DMLC_NUM_SERVER": "1",
             "PS_HEARTBEAT_INTERVAL": "0", "PSLAUNCH_SAME_HOST": "tcp"}
_KEY = 3


class _Frame:
    """A received frame as the transport gives it: ``.buffer`` and ``.bytes``."""

    __slots__ = ("bytes", "buffer")

    def __init__(self, data: bytes) -> None:
        self.bytes = data
        self.buffer = memoryview(data)


def _peer(role: str, rank: int) -> PeerInfo:
    return PeerInfo(role, rank, "127.0.0.1", 2000 + rank, f"{role}@127.0.0.1:{2000 + rank}", "-", "-")


class _ServerStandIn:
    """Answers a worker's messages in-process: init, barrier and the small round trip only."""

    def __init__(self, node: WorkerNode) -> None:
        self.inbox: collections.deque = collections.deque()
        self.value = b""
        self.kinds: collections.Counter = collections.Counter()  # messages by command
        node.transport.send = self.send
        node.transport.poll = self.poll
        node.transport.recv = self.inbox.popleft

    def poll(self, timeout: float) -> bool:
        if not self.inbox and timeout > 0:
            time.sleep(min(timeout, 0.0005))  # as a real poll waits: the network thread must not spin
        return bool(self.inbox)

    def send(self, peer: bytes, frames: list, track: bool = False, block: bool = True) -> None:
        cmd, _, req, arg = protocol.unpack_header(frames[0])
        self.kinds[cmd] += 1
        if cmd == protocol.Cmd.PUSH_PULL:
            self.inbox.append((peer, [_Frame(protocol.pack_value(req, 0, self.value))]))
        elif cmd == protocol.Cmd.PUSH:  # before the network thread parks, pushes leave on their own
            acks = np.array([[req, arg]], np.uint64).tobytes()
            self.inbox.append((peer, [_Frame(protocol.pack_header(protocol.Cmd.PUSH_ACK, 0, 1)), _Frame(acks)]))
        elif cmd == protocol.Cmd.PULL:
            self.inbox.append((peer, [_Frame(protocol.pack_value(req, 0, self.value))]))
        elif cmd == protocol.Cmd.INIT:
            self.value = bytes(frames[2])
            self.inbox.append((peer, [_Frame(protocol.pack_header(protocol.Cmd.INIT_ACK, req, arg))]))
        elif peer == SCHEDULER and cmd == protocol.Cmd.BARRIER:
            self.inbox.append((SCHEDULER, [_Frame(protocol.pack_header(protocol.Cmd.BARRIER_DONE, req))]))
        elif peer != SCHEDULER:
            raise SystemExit(f"python_cost: the worker sent {protocol.Cmd(cmd).name}, not the small round trip's frame")


def worker_cost(rounds: int, reps: int) -> float:
    """µs of the calling thread per push + pull round of one 4-float key."""
    import kvcore.dist_store as dist_store

    node = WorkerNode(read_env({**_CONTRACT, "DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1"}))
    node.rank = 0
    server = _peer("server", 0)
    node.servers, node.peers = [server], {server.uid.encode(): server}
    stand_in = _ServerStandIn(node)
    node._thread = threading.Thread(target=node._run, name="psnode-worker-0", daemon=True)
    node._thread.start()  # parks as in a job: the caller receives its own replies
    dist_store._node = node
    try:
        kv = dist_store.DistKVStore("dist_sync")
        value, out = np.ones(4, np.float32), np.zeros(4, np.float32)
        kv.init(_KEY, value)
        for _ in range(rounds // 2):  # warm up
            kv.push(_KEY, value)
            kv.pull(_KEY, out=out)
        best = float("inf")
        stand_in.kinds.clear()
        for _ in range(reps):
            start = time.thread_time()
            for _ in range(rounds):
                kv.push(_KEY, value)
                kv.pull(_KEY, out=out)
            best = min(best, time.thread_time() - start)
        # a round the OS delays past the network thread's hand-back may go the two-message way
        if stand_in.kinds[protocol.Cmd.PUSH_PULL] < 0.9 * rounds * reps:
            raise SystemExit(f"python_cost: the timed rounds were not the small round trip: {dict(stand_in.kinds)}")
        if out[0] != 1.0:
            raise SystemExit(f"python_cost: pulled {out[0]}, expected 1.0")
        return best / rounds * 1e6
    finally:
        dist_store._node = None
        node._stop_thread()
        node._thread.join(2)
        node.transport.close()


def server_cost(rounds: int, reps: int) -> float:
    """µs of the server's thread per round: 2 workers' PUSH_PULL frames in, 2 VALUE frames out."""
    node = ServerNode(read_env({**_CONTRACT, "DMLC_ROLE": "server", "DMLC_NUM_WORKER": "2"}))
    node.rank = 0
    workers = [_peer("worker", 0), _peer("worker", 1)]
    node.workers, node.peers = workers, {w.uid.encode(): w for w in workers}
    inbox: collections.deque = collections.deque()
    sent: list = []
    node.transport.send = lambda peer, frames, track=False, block=True: sent.append(frames[0])
    node.transport.poll = lambda timeout: bool(inbox)
    node.transport.recv = inbox.popleft
    node.store.init(_KEY, _KEY, np.ones(4, np.float32), True, 1)
    payload = np.ones(4, np.float32).tobytes()
    uids = [w.uid.encode() for w in workers]
    pushes = [0, 0]

    def one_round() -> None:
        for rank in (0, 1):
            pushes[rank] += 1
            req = 2 * pushes[rank]
            frame = protocol.pack_push_pull(req + 1, req, _KEY, 0, pushes[rank], payload)
            inbox.append((uids[rank], [_Frame(frame)]))
            node.process(0)

    try:
        for _ in range(rounds // 2):
            one_round()
        best = float("inf")
        for _ in range(reps):
            sent.clear()
            start = time.thread_time()
            for _ in range(rounds):
                one_round()
            best = min(best, time.thread_time() - start)
            if len(sent) != 2 * rounds:
                raise SystemExit(f"python_cost: the server sent {len(sent)} replies for {rounds} rounds of 2 workers")
        return best / rounds * 1e6
    finally:
        node.transport.close()


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--rounds", type=click.IntRange(100), default=4000, show_default=True, help="Rounds per batch.")
@click.option("--reps", type=click.IntRange(1), default=7, show_default=True, help="Batches; the best counts.")
def main(rounds: int, reps: int) -> None:
    worker = worker_cost(rounds, reps)
    server = server_cost(rounds, reps)
    click.echo(f"worker: {worker:.1f} µs of the calling thread per push + pull round (4-element key)")
    click.echo(f"server: {server:.1f} µs per round of 2 workers (2 PUSH_PULL frames in, 2 VALUE frames out)")


if __name__ == "__main__":
    main()
