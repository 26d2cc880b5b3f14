"""What a ``dist_sync`` round can cost at best, with no KVStore: raw pyzmq and plain sockets.

    python -m benchmarks.sync_round [--size-mib 4] [--rounds 60] [--reps 3] [--json out.json]

``benchmarks.run`` measures pslaunch against raw pyzmq's *echo*: each dealer's frame comes straight
back, whatever the other dealer does. A ``dist_sync`` round does more: the server waits for every
worker's push, sums them, and only then sends the sum back to each. This runs that round in the
same topology (one server process, 2 worker processes, 127.0.0.1) over two transports, so the
distance between pslaunch and the echo splits into what the round itself costs and what pslaunch
adds:

* ``zmq echo``: ``benchmarks.run``'s ceiling (DEALER/ROUTER, ``copy=False`` both ways).
* ``zmq round``: the server receives both pushes (zero-copy frames), sums them with one
  ``np.add`` into its buffer and sends it back to both (zero-copy).
* ``socket round``: the same over plain TCP sockets, a thread per worker connection on the server
  reading each push into a buffer of its own, the worker reading the sum straight into its out
  (what pslaunch's data lanes do, ``psnode.node.data_lanes``).
* ``+ copy``: the worker copies its value before it sends it (pslaunch's default push, which lets
  the caller change the array at once).

Every figure is bytes/s per worker (2 x size / median round), the median over ``--reps``
repetitions that run the variants back to back in a rotating order. Each process gives up after
``IDLE_TIMEOUT`` seconds without a message.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import numpy as np
import zmq

__all__ = ["VARIANTS", "run_variant"]

VARIANTS = ["zmq echo", "zmq round", "zmq round + copy", "socket round", "socket round + copy"]
WORKERS = 2
IDLE_TIMEOUT = 60.0
_WARMUP = 5


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise SystemExit(f"sync_round: the peer closed after {got} of {len(view)} bytes")
        got += n


def _zmq_server(port: int, size: int, echo: bool, rounds: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.rcvtimeo = int(IDLE_TIMEOUT * 1000)
    sock.bind(f"tcp://127.0.0.1:{port}")
    total = np.empty(size // 4, np.float32)
    try:
        for _ in range(rounds + _WARMUP):  # a round: one message of each worker
            pushes = []
            for _ in range(WORKERS):
                frames = sock.recv_multipart(copy=False)
                if echo:
                    sock.send_multipart([frames[0], frames[1]], copy=False)
                else:
                    pushes.append(frames)
            if pushes:
                np.add(np.frombuffer(pushes[0][1].buffer, np.float32), np.frombuffer(pushes[1][1].buffer, np.float32),
                       out=total)
                for frames in pushes:
                    sock.send_multipart([frames[0], total], copy=False)
    except zmq.Again:
        raise SystemExit(f"sync_round: the zmq server heard nothing for {IDLE_TIMEOUT:g} s")
    finally:
        sock.close(linger=1000)
        ctx.term()


def _zmq_worker(port: int, size: int, copy: bool, rounds: int) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = int(IDLE_TIMEOUT * 1000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    value, sent, out = np.ones(size // 4, np.float32), np.empty(size // 4, np.float32), np.empty(size // 4, np.float32)
    times = []
    try:
        for i in range(rounds + _WARMUP):
            start = time.perf_counter()
            if copy:
                np.copyto(sent, value)
            sock.send(sent if copy else value, copy=False)
            reply = sock.recv(copy=False)
            if copy:  # pslaunch's pull writes the reply into the caller's out
                np.copyto(out, np.frombuffer(reply.buffer, np.float32))
            if i >= _WARMUP:
                times.append(time.perf_counter() - start)
    except zmq.Again:
        raise SystemExit(f"sync_round: no reply from the zmq server for {IDLE_TIMEOUT:g} s")
    finally:
        sock.close()
        ctx.term()
    return times


def _socket_server(port: int, size: int, rounds: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(IDLE_TIMEOUT)
    conns = []
    for _ in range(WORKERS):
        conn, _ = listener.accept()
        conn.settimeout(IDLE_TIMEOUT)
        conns.append(conn)
    listener.close()
    pushes = [np.empty(size // 4, np.float32) for _ in conns]
    total = np.empty(size // 4, np.float32)
    barrier = threading.Barrier(WORKERS)
    failed: list[BaseException] = []

    def serve(i: int) -> None:  # a thread per connection: both pushes are read at once
        try:
            for _ in range(rounds + _WARMUP):
                _recv_exact(conns[i], memoryview(pushes[i]).cast("B"))
                if barrier.wait(IDLE_TIMEOUT) == 0:
                    np.add(pushes[0], pushes[1], out=total)
                barrier.wait(IDLE_TIMEOUT)
                conns[i].sendall(memoryview(total).cast("B"))
                barrier.wait(IDLE_TIMEOUT)  # nobody sums the next round while a reply still reads ``total``
        except BaseException as exc:  # a broken barrier or connection: the run fails, naming it
            failed.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for conn in conns:
        conn.close()
    if failed:
        raise SystemExit(f"sync_round: the socket server failed: {failed[0]!r}")


def _socket_worker(port: int, size: int, copy: bool, rounds: int) -> list[float]:
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=IDLE_TIMEOUT)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    value, sent, out = np.ones(size // 4, np.float32), np.empty(size // 4, np.float32), np.empty(size // 4, np.float32)
    times = []
    with sock:
        for i in range(rounds + _WARMUP):
            start = time.perf_counter()
            if copy:
                np.copyto(sent, value)
            sock.sendall(memoryview(sent if copy else value).cast("B"))
            _recv_exact(sock, memoryview(out).cast("B"))
            if i >= _WARMUP:
                times.append(time.perf_counter() - start)
    return times


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_variant(variant: str, size: int, rounds: int, timeout: float = 120.0) -> float:
    """Bytes/s per worker of one run of ``variant`` (one of ``VARIANTS``) with values of ``size`` bytes.

    Raises:
        RuntimeError: a process failed or did not end within ``timeout`` seconds (all are stopped).
    """
    port = _free_port()
    me = [sys.executable, "-m", "benchmarks.sync_round", "--role"]
    common = [variant, str(port), str(size), str(rounds)]
    cwd = Path(__file__).resolve().parent.parent
    server = subprocess.Popen(me + ["server"] + common, cwd=cwd)
    workers = [subprocess.Popen(me + ["worker"] + common, cwd=cwd, stdout=subprocess.PIPE, text=True)
               for _ in range(WORKERS)]
    try:
        outputs = [w.communicate(timeout=timeout)[0] for w in workers]
        server.wait(timeout=10)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"sync_round: {variant} did not end within {timeout:g} s") from exc
    finally:
        for proc in [server, *workers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [p.returncode for p in [server, *workers]]
    if any(codes):
        raise RuntimeError(f"sync_round: {variant} failed (exit codes {codes})")
    medians = [float(out.strip().splitlines()[-1]) for out in outputs]
    return 2 * size / statistics.mean(medians)


def _role(role: str, variant: str, port: int, size: int, rounds: int) -> None:
    copy = variant.endswith("+ copy")
    if role == "server":
        if variant.startswith("socket"):
            _socket_server(port, size, rounds)
        else:
            _zmq_server(port, size, variant == "zmq echo", rounds)
        return
    times = (_socket_worker if variant.startswith("socket") else _zmq_worker)(port, size, copy, rounds)
    print(statistics.median(times), flush=True)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--size-mib", type=float, default=4.0, show_default=True, help="Value size in MiB.")
@click.option("--rounds", type=click.IntRange(1), default=60, show_default=True, help="Timed rounds per run.")
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True, help="Repetitions (rotating order).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the figures here.")
@click.option("--role", nargs=5, hidden=True, default=None)
def main(size_mib: float, rounds: int, reps: int, json_path: Path | None, role: tuple | None) -> None:
    if role:
        _role(role[0], role[1], int(role[2]), int(role[3]), int(role[4]))
        return
    size = int(size_mib * (1 << 20)) // 4 * 4
    figures: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for variant in VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]:
            figures[variant].append(run_variant(variant, size, rounds))
    echo = statistics.median(figures["zmq echo"])
    print(f"{size / (1 << 20):g} MiB per worker, {WORKERS} workers, median of {reps} (bytes/s per worker; vs the echo)")
    for variant in VARIANTS:
        median = statistics.median(figures[variant])
        print(f"  {variant:<22} {median / 1e9:6.2f} GB/s  {median / echo:5.2f}x")
    if json_path is not None:
        json_path.write_text(json.dumps({"size": size, "rounds": rounds, "per_rep": figures}, indent=1))


if __name__ == "__main__":
    main()
