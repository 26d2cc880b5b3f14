"""One server and 64 to 1,024 workers in ``dist_sync`` rounds on one 1 MiB key: its cost per byte, and its memory.

    python -m benchmarks.server_scale [--workers 64,256,1024] [--rounds 5] [--mib 1] [--json out.json]

The scheduler and the server are the real ones (``python -m psnode scheduler`` / ``server``, each its
own process); the workers are simulated, many per process, with real sockets and the real wire
protocol (as in ``benchmarks.scheduler_scale``): each has a ZeroMQ ROUTER the server and the scheduler
connect to, and a DEALER with the worker's identity toward each of them. They REGISTER, read their
ADDRBOOK, worker 0 INITs the key (``dist_sync``, no updater: a round's sum becomes the value), and in
every round each worker sends a PUSH of the key (a view of one shared buffer: the simulator copies
nothing) and a PULL of it that must include that push, and reads the PULL_REPLY (checked: every element
is N, the round's sum).

Per N, over ``--rounds`` rounds after one to warm up:

* ``round_s``: from the first PUSH of a round to the last PULL_REPLY of it (median);
* ``server_cpu_s``: the server's CPU per round (every thread: its loop and ZeroMQ's I/O thread) and
  ``ns_per_byte``: that over the round's pushed bytes (N x the value): flat as N grows means the server
  spends the same per byte whatever the number of workers;
* ``rss_growth_mib``: the server's peak RSS over the rounds less its RSS after the INIT, also as
  ``copies`` of the value. The round itself holds its merge buffer and at most the one push it keeps as
  a view until a second comes (``psnode.server.rounds``); the pull replies send the stored value
  without a copy. What else grows is the pushes ZeroMQ has received and the server's loop has not
  merged yet.

The simulators run on the same cores as the server: on 2 cores their sending and reading is in every
wall-clock figure, not in the server's CPU.
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
import numpy as np
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.scheduler_scale import _alive, _cpu, _more_files, _status  # noqa: E402
from benchmarks.simulators import Simulators  # noqa: E402
from pscontract import contract_env, free_port  # noqa: E402
from psnode.node.protocol import (  # noqa: E402
    FLAG_ACKS,
    FLAG_ERROR,
    FLAG_OFFER,
    FLAG_SYNC,
    Cmd,
    pack_entries,
    pack_header,
    pack_json,
    unpack_entries,
    unpack_header,
    unpack_json,
)
from psnode.transport.zeromq import split_frames  # noqa: E402

KEY_ID = 1
#: Simulated workers per process: 512 keeps the two simulators of 1,024 workers on both cores.
WORKERS_PER_PROCESS = 512


class SimWorkers:
    """The simulated workers ``ranks`` of a job (in one process); see the module docstring."""

    def __init__(self, ranks: range, scheduler_port: int, job_id: str, pids: tuple[int, int], values: int,
                 job_workers: int, window: int) -> None:
        _more_files(8 * len(ranks) + 1024)  # a ROUTER, two DEALERs, their connections and mailboxes per worker
        self.pids = pids  # the scheduler's and the server's: either ending fails a wait at once
        self.job_workers = job_workers  # every element of a round's sum
        self.window = window  # PSLAUNCH_PUSH_WINDOW
        self.invited = 0
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, 4 * len(ranks) + 64)
        self.value = np.ones(values, np.float32)  # every worker pushes this buffer: a round's sum is N everywhere
        self.workers = []
        for rank in ranks:
            uid = f"sim-worker-{rank}".encode()
            router = self.ctx.socket(zmq.ROUTER)
            router.linger = 0
            port = router.bind_to_random_port("tcp://127.0.0.1")
            to_scheduler = self._dealer(uid, f"tcp://127.0.0.1:{scheduler_port}")
            info = {"role": "worker", "host": "127.0.0.1", "port": port, "uid": uid.decode(),
                    "fingerprint": f"sim-{rank}", "local_name": f"sim-{rank}", "shm_probe": 0, "pid": os.getpid(),
                    "lane_port": 0, "worker_id": rank, "job_id": job_id}
            self.workers.append({"rank": rank, "uid": uid, "router": router, "scheduler": to_scheduler,
                                 "server": None, "info": info})
        self.poller = zmq.Poller()
        for worker in self.workers:
            self.poller.register(worker["router"], zmq.POLLIN)
        self.by_socket = {worker["router"]: worker for worker in self.workers}

    def _dealer(self, uid: bytes, endpoint: str) -> zmq.Socket:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.identity = uid
        dealer.sndhwm = dealer.rcvhwm = 1000
        dealer.connect(endpoint)
        return dealer

    def receive(self, want: int, timeout: float, keep=lambda cmd: True) -> list[tuple[dict, int, int, list]]:
        """Read every worker's ROUTER until ``want`` messages that ``keep`` accepts came: ``[(worker,
        cmd, req_id, frames), ...]``.

        Raises:
            TimeoutError: fewer came within ``timeout`` (the count says how many).
            RuntimeError: the scheduler or the server ended, or a reply carries an error.
        """
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < want:
            if not all(_alive(pid) for pid in self.pids):
                raise RuntimeError("the scheduler or the server ended")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(got)} of {want} messages in {timeout:g} s")
            for sock, _ in self.poller.poll(min(left, 1.0) * 1000):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    frames = frames[1:]
                    if len(frames) == 1:  # small frames travel joined (psnode.transport.zeromq)
                        frames = split_frames(frames[0].buffer) or frames
                    cmd, flags, req_id, _ = unpack_header(frames[0].buffer if hasattr(frames[0], "buffer")
                                                          else frames[0])
                    if flags & FLAG_ERROR:
                        raise RuntimeError(f"{Cmd(cmd).name}: {unpack_json(frames[1])}")
                    if keep(cmd):
                        got.append((self.by_socket[sock], cmd, req_id, frames))
        return got

    # -- the phases, each run in every simulator process at once ----------------------------------------
    def register(self, _: object) -> None:
        """Register every worker; connect to the server its address book names."""
        for worker in self.workers:
            worker["scheduler"].send_multipart([pack_header(Cmd.REGISTER), pack_json(worker["info"])])
        for worker, _, _, frames in self.receive(len(self.workers), 300, keep=lambda cmd: cmd == Cmd.ADDRBOOK):
            (server,) = [n for n in unpack_json(frames[1])["nodes"] if n["role"] == "server"]
            worker["server"] = self._dealer(worker["uid"], f"tcp://{server['host']}:{server['port']}")

    def init(self, _: object) -> None:
        """Worker 0 (in the first simulator) initialises the key; the others wait for the parent."""
        worker = self.workers[0]
        zeros = np.zeros_like(self.value)
        spec = [{"key": KEY_ID, "user_key": 0, "shape": [zeros.size], "dtype": "float32", "frame": 0}]
        worker["server"].send_multipart([pack_header(Cmd.INIT, 1, flags=FLAG_SYNC), pack_json(spec), zeros])
        self.receive(1, 60, keep=lambda cmd: cmd == Cmd.INIT_ACK)

    def round(self, number: int) -> dict:
        """Every worker here pushes the key and pulls it back; when the first push left and the last reply came.

        As a worker does (``psnode.worker.data_path``): when the job's workers could together send more
        than the push window of the key, each offers its push and sends it once the server invites it.
        """
        seq = number + 1  # pushes of the key each worker has issued, this one included
        nbytes = self.value.nbytes
        push_meta = pack_entries([(KEY_ID, 0, 1, 0, 0, nbytes, seq)])
        pull_meta = pack_entries([(KEY_ID, 0, 0, 0, 0, nbytes, seq)])
        push = [pack_header(Cmd.PUSH, 2 * seq, 1), push_meta, b"", self.value]
        offering = self.window > 0 and nbytes * self.job_workers > self.window
        first = time.monotonic()
        for worker in self.workers:
            server = worker["server"]
            if offering:
                server.send_multipart([pack_header(Cmd.PUSH, 2 * seq, 1, FLAG_OFFER), push_meta])
            else:
                server.send_multipart(push, copy=False)
            server.send_multipart([pack_header(Cmd.PULL, 2 * seq + 1), pull_meta])
        replies = []
        while len(replies) < len(self.workers):
            for message in self.receive(1, 600, keep=lambda cmd: cmd in (Cmd.PULL_REPLY, Cmd.PUSH_INVITE)):
                worker, cmd, req_id, _ = message
                if cmd == Cmd.PUSH_INVITE:
                    assert req_id == 2 * seq, (worker["rank"], req_id, seq)
                    worker["server"].send_multipart(push, copy=False)
                else:
                    replies.append(message)
        self.invited += len(self.workers) if offering else 0
        last = time.monotonic()
        expected = float(self.job_workers)
        for worker, _, req_id, frames in replies:
            assert req_id == 2 * seq + 1, (worker["rank"], req_id, seq)
            header = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
            data_frames = frames[2:-1] if unpack_header(header)[1] & FLAG_ACKS else frames[2:]
            (entry,) = unpack_entries(frames[1].buffer if hasattr(frames[1], "buffer") else frames[1])
            value = np.frombuffer(data_frames[entry[2]].buffer, np.float32)
            assert value.size == self.value.size and value[0] == value[-1] == expected, (value[:2], expected)
        return {"first": first, "last": last, "offered": offering}

    def close(self) -> None:
        for worker in self.workers:
            for name in ("router", "scheduler", "server"):
                if worker[name] is not None:
                    worker[name].close(0)
        self.ctx.term()


def _node(role: str, port: int, workers: int, job_id: str, window: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO),
           **contract_env(role=role, root_uri="127.0.0.1", root_port=port, num_workers=workers, num_servers=1,
                          job_id=job_id, all_local=True, rank=0, local_rank=0, local_size=1,
                          settings={"PSLAUNCH_REGISTER_TIMEOUT": "600", "PS_HEARTBEAT_TIMEOUT": "900",
                                    "PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_PUSH_WINDOW": str(window)})}
    env.pop("PSLAUNCH_JOB_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "psnode", role], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def run_one(workers: int, rounds: int, mib: float, window: int = 256 << 20) -> dict:
    values = int(mib * (1 << 20)) // 4
    port = free_port()
    job_id = f"sim-server-{os.getpid()}-{workers}"
    scheduler = _node("scheduler", port, workers, job_id, window)
    server = _node("server", port, workers, job_id, window)
    result: dict = {"workers": workers, "value_mib": values * 4 / (1 << 20), "rounds": rounds,
                    "window_mib": window / (1 << 20), "offered": window > 0 and workers * values * 4 > window}
    sims = None
    try:
        pids = (scheduler.pid, server.pid)
        sims = Simulators(lambda ranks: SimWorkers(ranks, port, job_id, pids, values, workers, window), workers,
                          WORKERS_PER_PROCESS, "simulated workers")
        result["simulator_processes"] = len(sims.procs)
        sims.run("register")
        sims.run("init", only_first=True)
        rss_before = _status(server.pid, "VmRSS")  # the server holding the key, before any round
        sims.run("round", 0)  # one to warm up: the server's first replies, the buffers' first pages
        cpu_before = _cpu(server.pid)
        times = []
        for number in range(1, rounds + 1):
            results = sims.run("round", number)
            times.append(max(r["last"] for r in results) - min(r["first"] for r in results))
        cpu = (_cpu(server.pid) - cpu_before) / rounds
        peak = _status(server.pid, "VmHWM")
        pushed = workers * values * 4
        result.update(round_s=statistics.median(times), round_s_range=[min(times), max(times)],
                      server_cpu_s=cpu, ns_per_byte=cpu / pushed * 1e9,
                      wall_ns_per_byte=statistics.median(times) / pushed * 1e9,
                      rss_before_mib=rss_before / 1024, rss_peak_mib=peak / 1024,
                      rss_growth_mib=(peak - rss_before) / 1024,
                      copies=(peak - rss_before) * 1024 / (values * 4))
    finally:
        if sims is not None:
            sims.close()
        for proc in (server, scheduler):
            proc.kill()
            err = proc.communicate()[1]
            if "round_s" not in result:
                result.setdefault("stderr", []).append(err[-2000:])
    return result


@click.command()
@click.option("--workers", default="64,256,1024", show_default=True, help="Simulated workers, one job per count.")
@click.option("--rounds", default=5, show_default=True)
@click.option("--mib", default=1.0, show_default=True, help="The key's size in MiB (float32).")
@click.option("--window-mib", default=256.0, show_default=True,
              help="PSLAUNCH_PUSH_WINDOW of the job, in MiB (0: none, every push sent at once).")
@click.option("--json", "json_path", default=None)
def main(workers: str, rounds: int, mib: float, window_mib: float, json_path: str | None) -> None:
    rows = []
    for count in (int(n) for n in workers.split(",")):
        row = run_one(count, rounds, mib, int(window_mib * (1 << 20)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


def table(rows: list[dict]) -> str:
    """The rows as the table ``benchmarks.scale`` and docs/scale.md show."""
    lines = [f"{'workers':>7} {'offered':>7} {'round s':>8} {'server CPU s':>12} {'ns/byte':>8} {'vs first':>8} "
             f"{'RSS MiB':>8} {'growth MiB':>10} {'copies':>7}"]
    base = rows[0]["ns_per_byte"] if rows and rows[0]["ns_per_byte"] else None  # CPU clock ticks: 0 for tiny jobs
    for r in rows:
        lines.append(f"{r['workers']:>7} {'yes' if r['offered'] else 'no':>7} {r['round_s']:>8.3f} {r['server_cpu_s']:>12.3f} {r['ns_per_byte']:>8.3f} "
                     f"{r['ns_per_byte'] / base if base else 0:>7.2f}x {r['rss_peak_mib']:>8.0f} {r['rss_growth_mib']:>10.1f} "
                     f"{r['copies']:>7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
