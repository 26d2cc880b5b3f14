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

The simulated nodes live in as few processes as the open-file limit allows (``NODES_PER_PROCESS``, 2,048:
each node holds about five open files). The simulator runs on the same machine's cores: on 2 cores its
own work slows what it measures.
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

from benchmarks.simulators import Simulators  # noqa: E402
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
    """The simulated nodes ``indices`` of a job (in one process); see the module docstring."""

    def __init__(self, indices: range, servers: int, port: int, job_id: str, scheduler_pid: int) -> None:
        _more_files(6 * len(indices) + 1024)  # a ROUTER, a DEALER, their connections and ZeroMQ's mailboxes per node
        self.scheduler_pid = scheduler_pid
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, 4 * len(indices) + 64)
        self.nodes = []
        for i in indices:
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
        self.watch_scheduler = True  # its end fails a wait at once (not once it named a dead node)

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
            if self.watch_scheduler and not _alive(self.scheduler_pid):
                raise RuntimeError("the scheduler ended")
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

    # -- the phases, each run in every simulator process at once ----------------------------------------
    def register(self, _: object) -> dict:
        """Register every node; wait for the books (nodes holding theirs heartbeat meanwhile, as real
        ones do). When the last REGISTER went out and the last book came (``time.monotonic``: one clock
        for every process of the machine), the books' sizes, what else came."""
        for node in self.nodes:
            self.send(node, Cmd.REGISTER, node["info"])
        sent = time.monotonic()
        books: dict[bytes, list] = {}
        beat = sent
        while len(books) < len(self.nodes):
            for uid, msgs in self.receive(len(self.nodes) - len(books), 0.5, partial=True).items():
                books.setdefault(uid, []).extend(m for m in msgs if m[0] != Cmd.HEARTBEAT_ACK)
            books = {uid: msgs for uid, msgs in books.items() if msgs}
            if time.monotonic() - beat > 1.0:
                beat = time.monotonic()
                for node in self.nodes:
                    if node["uid"] in books:
                        self.send(node, Cmd.HEARTBEAT)
            if time.monotonic() - sent > 600:
                raise TimeoutError(f"{len(books)} of {len(self.nodes)} address books in 600 s")
        messages = [m for msgs in books.values() for m in msgs]
        odd = [bytes(frames[0])[:200] if frames else b"" for cmd, frames, _ in messages if cmd != Cmd.ADDRBOOK]
        return {"sent": sent, "last": max(t for _, _, t in messages), "odd": odd,
                "sizes": [sum(len(f) for f in frames) for _, frames, _ in messages]}

    def barrier(self, round_: int) -> dict:
        """Every worker here enters a barrier of the workers; when the last went in and the last came out."""
        workers = [n for n in self.nodes if n["role"] == "worker"]
        for node in workers:
            self.send(node, Cmd.BARRIER, req_id=round_ + 1, arg=int(Group.WORKERS))
        sent = time.monotonic()
        done = self.receive(len(workers), 120) if workers else {}
        return {"sent": sent, "done": max((t for msgs in done.values() for _, _, t in msgs), default=sent)}

    def heartbeats(self, seconds: float) -> float:
        """Every node heartbeats once a second for ``seconds``; the last round's start."""
        start = tick = time.monotonic()
        while time.monotonic() - start < seconds:
            tick = time.monotonic()
            for node in self.nodes:
                self.send(node, Cmd.HEARTBEAT)
            self.receive(len(self.nodes), 30)  # the acks
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        return tick

    def death(self, args: tuple) -> dict:
        """The node ``silent`` says nothing from now on, the others heartbeat; when each of them heard
        of its death (``{uid: when}``), waiting at most ``limit`` seconds."""
        silent, limit = args
        others = [n for n in self.nodes if n["uid"] != silent]
        self.watch_scheduler = False  # it ends after naming the dead node
        told: dict[bytes, float] = {}
        start = time.monotonic()
        while len(told) < len(others) and time.monotonic() - start < limit:
            tick = time.monotonic()
            for node in others:
                self.send(node, Cmd.HEARTBEAT)
            for uid, msgs in self.receive(2 * len(others), 1.0, partial=True).items():
                for cmd, frames, t in msgs:
                    if cmd == Cmd.NODE_DIED and uid not in told:
                        assert silent.decode().split("-")[-1] in json.dumps(unpack_json(frames[0]))
                        told[uid] = t
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        return {"told": len(told), "of": len(others), "last": max(told.values(), default=None)}

    def close(self) -> None:
        for node in self.nodes:
            node["router"].close(0)
            node["dealer"].close(0)
        self.ctx.term()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


#: Nodes one simulator process holds at most: about 5 open files each, under a hard limit of 20,000.
NODES_PER_PROCESS = 2048


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
    sims = Simulators(lambda indices: SimNodes(indices, servers, port, job_id, scheduler.pid), count,
                      NODES_PER_PROCESS, "simulated nodes")
    result: dict = {"nodes": count, "servers": servers, "workers": workers, "simulator_processes": len(sims.procs)}
    try:
        time.sleep(0.5)
        books = sims.run("register")
        odd = [o for b in books for o in b["odd"]]
        assert not odd, f"not an address book: {odd[:2]}"
        sizes = [size for b in books for size in b["sizes"]]
        result.update(book_s=max(b["last"] for b in books) - max(b["sent"] for b in books),
                      book_bytes_total=sum(sizes), book_bytes_max=max(sizes))
        times = []
        for round_ in range(5):
            rounds = sims.run("barrier", round_)
            times.append(max(r["done"] for r in rounds) - max(r["sent"] for r in rounds))
        result["barrier_ms"] = statistics.median(times) * 1000
        before, start = _cpu(scheduler.pid), time.monotonic()
        ticks = sims.run("heartbeats", 10.0)  # every node, once a second
        result["heartbeat_cpu"] = (_cpu(scheduler.pid) - before) / (time.monotonic() - start)
        result["rss_mib"] = _status(scheduler.pid, "VmHWM") / 1024
        silent = f"sim-worker-{workers - 1}".encode()  # the job's last node, in the last simulator
        quiet_since = ticks[-1]  # its last heartbeat went out in that round
        deaths = sims.run("death", (silent, death_timeout * 3 + 30))
        told, of = sum(d["told"] for d in deaths), sum(d["of"] for d in deaths)
        last = max((d["last"] for d in deaths if d["last"] is not None), default=None)
        result["death_s"] = (last - quiet_since) if last is not None else None
        result["death_told"] = f"{told} of {of}"
        result["death_timeout_s"] = death_timeout
    finally:
        scheduler.kill()
        err = scheduler.communicate()[1]
        sims.close()
    if result.get("death_s") is None:
        result["scheduler_stderr"] = err[-2000:]
    return result


def table(rows: list[dict]) -> str:
    """The rows as the table ``benchmarks.scale`` and docs/scale.md show."""
    lines = [f"{'nodes':>6} {'servers':>7} {'book s':>8} {'books MB':>9} {'max book KB':>11} {'barrier ms':>10} "
             f"{'hb CPU':>7} {'RSS MiB':>8} {'death s':>8}"]
    for r in rows:
        death = (f"{r['death_s']:.1f} ({r['death_told']})" if r.get("death_s") is not None else "-")
        lines.append(f"{r['nodes']:>6} {r['servers']:>7} {r['book_s']:>8.2f} {r['book_bytes_total'] / 1e6:>9.1f} "
                     f"{r['book_bytes_max'] / 1e3:>11.1f} {r['barrier_ms']:>10.1f} {r['heartbeat_cpu'] * 100:>6.1f}% "
                     f"{r['rss_mib']:>8.0f} {death:>8}")
    return "\n".join(lines)


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
    print("\n" + table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
