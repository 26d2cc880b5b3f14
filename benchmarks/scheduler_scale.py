"""The scheduler with 256 to 4,096 nodes: registration, the address book, barriers, heartbeats, a death.

    python -m benchmarks.scheduler_scale [--nodes 256,1024,4096] [--servers-per 8] [--json out.json]

The scheduler is the real one (``python -m psnode scheduler``, its own process); the nodes are
simulated, many per process, with real sockets and the real wire protocol: each has a ZeroMQ ROUTER
bound on 127.0.0.1 (the scheduler connects to it, as to a node) and a DEALER with the node's identity
toward the scheduler, and speaks ``psnode.node.protocol``'s REGISTER, HEARTBEAT, BARRIER and reads
ADDRBOOK, BARRIER_DONE and NODE_DIED. A job of N nodes has N/``servers-per`` servers (at least 1, at
most ``--max-servers``, 64: the jobs users run have 8 to 64).
Per N:

* ``book_s``: from the last REGISTER sent to the last node holding its address book; ``book_bytes``:
  the bytes of every address book together, and of the largest;
* ``barrier_ms``: a barrier of every worker, from the last BARRIER sent to the last BARRIER_DONE
  received (median of 5);
* ``heartbeat_cpu``: the scheduler's CPU over 10 s of every node heartbeating once a second (the
  default interval), as a share of one core;
* ``rss_mib``: the scheduler's peak RSS;
* ``death_s``: one node stops heartbeating; the seconds until every other node has the NODE_DIED
  naming it, counted from its last heartbeat, beside the heartbeat timeout (``--death-timeout``).

The simulator itself runs on the same machine's cores: on 2 cores its own work slows what it measures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pscontract import contract_env, free_port  # noqa: E402
from psnode.node.protocol import Cmd, Group, pack_header, pack_json, unpack_header, unpack_json  # noqa: E402
from psnode.transport.zeromq import split_frames  # noqa: E402


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _more_files(want: int) -> None:
    """Raise this process's open-file limits to ``want`` (the hard one too, where allowed: root)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SimNodes:
    """N simulated nodes in this process; see the module docstring."""

    def __init__(self, count: int, servers: int, port: int, job_id: str) -> None:
        _more_files(6 * count + 1024)  # a ROUTER, a DEALER, their connections and ZeroMQ's mailboxes per node
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, 4 * count + 64)
        self.nodes = []
        for i in range(count):
            role = "server" if i < servers else "worker"
            rank = i if role == "server" else i - servers
            uid = f"sim-{role}-{rank}".encode()
            router = self.ctx.socket(zmq.ROUTER)
            router.linger = 0
            node_port = router.bind_to_random_port("tcp://127.0.0.1")
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.identity = uid
            dealer.sndhwm = dealer.rcvhwm = 100000
            dealer.connect(f"tcp://127.0.0.1:{port}")
            info = {"role": role, "host": "127.0.0.1", "port": node_port, "uid": uid.decode(),
                    "fingerprint": f"sim-{i}", "local_name": f"sim-{i}", "shm_probe": 0, "pid": os.getpid(),
                    "lane_port": 0, "worker_id": rank if role == "worker" else None, "job_id": job_id}
            self.nodes.append({"role": role, "uid": uid, "router": router, "dealer": dealer, "info": info})
        self.poller = zmq.Poller()
        for node in self.nodes:
            self.poller.register(node["router"], zmq.POLLIN)
        self.by_socket = {node["router"]: node for node in self.nodes}
        self.scheduler: subprocess.Popen | None = None  # its early end fails a wait at once

    def send(self, node: dict, cmd: int, body=None, req_id: int = 0, arg: int = 0) -> None:
        frames = [pack_header(cmd, req_id, arg)] + ([pack_json(body)] if body is not None else [])
        node["dealer"].send_multipart(frames)

    def receive(self, want: int, timeout: float, partial: bool = False) -> dict[bytes, list]:
        """Read every node's ROUTER until ``want`` messages arrived; ``{node uid: [(cmd, frames,
        when), ...]}``. After ``timeout``: what came (``partial``), else ``TimeoutError``."""
        got: dict[bytes, list] = {}
        count = 0
        deadline = time.monotonic() + timeout
        while count < want:
            if self.scheduler is not None and self.scheduler.poll() is not None:
                raise RuntimeError(f"the scheduler exited with {self.scheduler.returncode}: "
                                   f"{self.scheduler.communicate()[1][-1500:]}")
            left = deadline - time.monotonic()
            if left <= 0:
                if partial:
                    return got
                raise TimeoutError(f"{count} of {want} messages in {timeout:g} s")
            for sock, _ in self.poller.poll(min(left, 1.0) * 1000):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    frames = frames[1:]
                    if len(frames) == 1:  # small frames travel joined (psnode.transport.zeromq)
                        frames = [bytes(getattr(f, "buffer", f)) for f in (split_frames(memoryview(frames[0])) or frames)]
                    cmd = unpack_header(frames[0])[0]
                    got.setdefault(self.by_socket[sock]["uid"], []).append((cmd, frames[1:], time.monotonic()))
                    count += 1
        return got

    def close(self) -> None:
        for node in self.nodes:
            node["router"].close(0)
            node["dealer"].close(0)
        self.ctx.term()


def run_one(count: int, servers_per: int, death_timeout: float, max_servers: int = 64) -> dict:
    servers = max(1, min(max_servers, count // servers_per))
    workers = count - servers
    port = free_port()
    job_id = f"sim-{os.getpid()}-{count}"
    env = {**os.environ, "PYTHONPATH": str(REPO),
           **contract_env(role="scheduler", root_uri="127.0.0.1", root_port=port, num_workers=workers,
                          num_servers=servers, job_id=job_id, all_local=True, rank=0, local_rank=0, local_size=1,
                          settings={"PSLAUNCH_REGISTER_TIMEOUT": "600", "PS_HEARTBEAT_TIMEOUT": f"{death_timeout:g}",
                                    "PSLAUNCH_SAME_HOST": "tcp"})}
    env.pop("PSLAUNCH_JOB_KEY", None)
    scheduler = subprocess.Popen([sys.executable, "-m", "psnode", "scheduler"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    sim = SimNodes(count, servers, port, job_id)
    sim.scheduler = scheduler
    result: dict = {"nodes": count, "servers": servers, "workers": workers}
    try:
        time.sleep(0.5)
        for node in sim.nodes:
            sim.send(node, Cmd.REGISTER, node["info"])
        registered = time.monotonic()
        books: dict[bytes, list] = {}
        beat = time.monotonic()
        while len(books) < count:  # nodes holding their book heartbeat meanwhile, as real ones do
            for uid, msgs in sim.receive(count - len(books), 0.5, partial=True).items():
                books.setdefault(uid, []).extend(m for m in msgs if m[0] != Cmd.HEARTBEAT_ACK)
            if time.monotonic() - beat > 1.0:
                beat = time.monotonic()
                for node in sim.nodes:
                    if node["uid"] in books:
                        sim.send(node, Cmd.HEARTBEAT)
            if time.monotonic() - registered > 600:
                raise TimeoutError(f"{len(books)} of {count} address books in 600 s")
        books = {uid: msgs for uid, msgs in books.items() if msgs}
        last = max(t for msgs in books.values() for _, _, t in msgs)
        sizes = [sum(len(f) for f in frames) for msgs in books.values() for _, frames, _ in msgs]
        odd = [(cmd, frames[:1]) for msgs in books.values() for cmd, frames, _ in msgs if cmd != Cmd.ADDRBOOK]
        assert not odd, f"not an address book: {odd[:2]}"
        result.update(book_s=last - registered, book_bytes_total=sum(sizes), book_bytes_max=max(sizes))
        worker_nodes = [n for n in sim.nodes if n["role"] == "worker"]
        times = []
        for round_ in range(5):
            for node in worker_nodes:
                sim.send(node, Cmd.BARRIER, req_id=round_ + 1, arg=int(Group.WORKERS))
            sent = time.monotonic()
            done = sim.receive(len(worker_nodes), 120)
            times.append(max(t for msgs in done.values() for _, _, t in msgs) - sent)
        result["barrier_ms"] = statistics.median(times) * 1000
        before, start = _cpu(scheduler.pid), time.monotonic()
        while time.monotonic() - start < 10:  # every node, once a second
            tick = time.monotonic()
            for node in sim.nodes:
                sim.send(node, Cmd.HEARTBEAT)
            sim.receive(count, 30)  # the acks
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        result["heartbeat_cpu"] = (_cpu(scheduler.pid) - before) / (time.monotonic() - start)
        result["rss_mib"] = _status(scheduler.pid, "VmHWM") / 1024
        silent = sim.nodes[-1]
        quiet_since = tick  # its last heartbeat went out in the last round above
        others = [n for n in sim.nodes if n is not silent]
        sim.scheduler = None  # it ends after naming the dead node
        told: dict[bytes, float] = {}
        while len(told) < len(others) and time.monotonic() - quiet_since < death_timeout * 3 + 30:
            tick = time.monotonic()
            for node in others:
                sim.send(node, Cmd.HEARTBEAT)
            got = sim.receive(2 * len(others), 1.0, partial=True)  # acks, and the news
            for uid, msgs in got.items():
                for cmd, frames, t in msgs:
                    if cmd == Cmd.NODE_DIED and uid not in told:
                        assert silent["uid"].decode().split("-")[-1] in json.dumps(unpack_json(frames[0]))
                        told[uid] = t
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        result["death_s"] = (max(told.values()) - quiet_since) if told else None
        result["death_told"] = f"{len(told)} of {len(others)}"
        result["death_timeout_s"] = death_timeout
    finally:
        scheduler.kill()
        try:
            err = scheduler.communicate()[1]
        except ValueError:  # read already, by the error that ended the run
            err = ""
        sim.close()
    if "death_s" not in result:
        result["scheduler_stderr"] = err[-2000:]
    return result


@click.command()
@click.option("--nodes", default="256,1024,4096", show_default=True)
@click.option("--servers-per", default=8, show_default=True, help="One server per this many nodes.")
@click.option("--max-servers", default=64, show_default=True, help="At most this many servers.")
@click.option("--death-timeout", default=10.0, show_default=True, help="PS_HEARTBEAT_TIMEOUT of the scheduler.")
@click.option("--json", "json_path", default=None)
def main(nodes: str, servers_per: int, max_servers: int, death_timeout: float, json_path: str | None) -> None:
    rows = []
    for count in (int(n) for n in nodes.split(",")):
        row = run_one(count, servers_per, death_timeout, max_servers)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'nodes':>6} {'servers':>7} {'book s':>8} {'books MB':>9} {'max book KB':>11} {'barrier ms':>10} "
          f"{'hb CPU':>7} {'RSS MiB':>8} {'death s':>8}")
    for r in rows:
        death = (f"{r['death_s']:.1f} ({r['death_told']})" if r.get("death_s") is not None else "-")
        print(f"{r['nodes']:>6} {r['servers']:>7} {r['book_s']:>8.2f} {r['book_bytes_total'] / 1e6:>9.1f} "
              f"{r['book_bytes_max'] / 1e3:>11.1f} {r['barrier_ms']:>10.1f} {r['heartbeat_cpu'] * 100:>6.1f}% "
              f"{r['rss_mib']:>8.0f} {death:>8}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
