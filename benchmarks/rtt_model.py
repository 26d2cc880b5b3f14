"""What a small push+pull round trip costs by message pattern, in plain pyzmq: a model, not pslaunch.

    python -m benchmarks.rtt_model [--reps 3] [--rounds 400]

Two DEALER clients and one Python ROUTER server on 127.0.0.1 exchange 4-element-sized messages in
three patterns, every client independent (no dist_sync coupling):

- ``separate``: a push (3 frames) and a pull (2 frames) sent back to back; the server acks the
  push (2 frames) and answers the pull (3 frames); the calling thread reads both replies.
- ``handoff``: the same, but a receiving thread owns the socket and hands the pull reply to the
  caller through a ``concurrent.futures.Future`` (as pslaunch's worker does).
- ``fused``: one single-frame request carrying push and pull, one single-frame reply.

Prints the median round per client. The gap between ``separate`` and ``handoff`` is the cost of the
thread hand-off; the gap to ``fused`` the cost of the extra messages and frames.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import subprocess
import sys
import threading
import time

import click
import zmq

from testkit import free_port

PATTERNS = ("separate", "handoff", "fused")
TIMEOUT_MS = 20_000
WARMUP = 50

_HDR, _ENTRIES, _PAYLOAD = b"h" * 24, b"e" * 48, b"x" * 16


def serve(port: int, clients: int) -> None:
    """Answer pushes, pulls and fused requests until every client said it is done."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.rcvtimeo = TIMEOUT_MS
    sock.bind(f"tcp://127.0.0.1:{port}")
    done = 0
    try:
        while done < clients:
            frames = sock.recv_multipart()
            ident, kind = frames[0], frames[1][:1]
            if kind == b"Q":
                done += 1
            elif kind == b"P":
                sock.send_multipart([ident, b"A" + _HDR[1:], _ENTRIES])
            elif kind == b"L":
                sock.send_multipart([ident, b"R" + _HDR[1:], _ENTRIES, _PAYLOAD])
            else:  # fused
                sock.send(ident, zmq.SNDMORE)
                sock.send(b"R" * 88)
    finally:
        sock.close(0)
        ctx.term()


def _separate_round(sock: zmq.Socket) -> None:
    sock.send_multipart([b"P" + _HDR[1:], _ENTRIES, _PAYLOAD])
    sock.send_multipart([b"L" + _HDR[1:], _ENTRIES])
    sock.recv_multipart()
    sock.recv_multipart()


def _fused_round(sock: zmq.Socket) -> None:
    sock.send(b"F" * 88)
    sock.recv()


def _handoff_rounds(ctx: zmq.Context, sock: zmq.Socket, total: int) -> list[float]:
    # the network thread owns the socket; the caller queues sends through an inproc pair
    inbox, outbox = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    inbox.bind("inproc://sends")
    outbox.connect("inproc://sends")
    waiting: list[concurrent.futures.Future] = []
    lock = threading.Lock()

    def network() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(TIMEOUT_MS))
            if not ready:
                return
            if inbox in ready:
                frames = inbox.recv_multipart()
                if frames[0] == b"Q":
                    return
                sock.send_multipart(frames)
            if sock in ready and sock.recv_multipart()[0][:1] == b"R":
                with lock:
                    future = waiting.pop(0)
                future.set_result(None)

    thread = threading.Thread(target=network, daemon=True)
    thread.start()
    times = []
    try:
        for _ in range(total):
            t = time.perf_counter()
            future: concurrent.futures.Future = concurrent.futures.Future()
            with lock:
                waiting.append(future)
            outbox.send_multipart([b"P" + _HDR[1:], _ENTRIES, _PAYLOAD])
            outbox.send_multipart([b"L" + _HDR[1:], _ENTRIES])
            future.result(TIMEOUT_MS / 1e3)
            times.append(time.perf_counter() - t)
    finally:
        outbox.send(b"Q")
        thread.join(TIMEOUT_MS / 1e3)
        inbox.close(0)
        outbox.close(0)
    return times


def client(port: int, pattern: str, rounds: int) -> float:
    """Run ``rounds`` timed rounds of ``pattern`` after a warm-up; return the median in µs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = TIMEOUT_MS
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        if pattern == "handoff":
            times = _handoff_rounds(ctx, sock, WARMUP + rounds)
        else:
            one_round = _separate_round if pattern == "separate" else _fused_round
            times = []
            for _ in range(WARMUP + rounds):
                t = time.perf_counter()
                one_round(sock)
                times.append(time.perf_counter() - t)
        sock.send(b"Q")
    finally:
        sock.close(linger=1000)
        ctx.term()
    return statistics.median(times[WARMUP:]) * 1e6


def _run_pattern(pattern: str, rounds: int, clients: int = 2) -> list[float]:
    port = free_port()
    me = [sys.executable, __file__]
    procs = [subprocess.Popen(me + ["--serve", str(port), "--clients", str(clients)])]
    try:
        procs += [subprocess.Popen(me + ["--client", str(port), "--pattern", pattern, "--rounds", str(rounds)],
                                   stdout=subprocess.PIPE, text=True) for _ in range(clients)]
        medians = [float(p.communicate(timeout=TIMEOUT_MS / 1e3 * 3)[0].split()[-1]) for p in procs[1:]]
        procs[0].wait(timeout=TIMEOUT_MS / 1e3)
        return medians
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@click.command()
@click.option("--reps", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option("--rounds", type=click.IntRange(10, 100_000), default=400, show_default=True)
@click.option("--serve", "serve_port", type=int, hidden=True)
@click.option("--clients", type=int, default=2, hidden=True)
@click.option("--client", "client_port", type=int, hidden=True)
@click.option("--pattern", type=click.Choice(PATTERNS), hidden=True)
def main(reps: int, rounds: int, serve_port: int | None, clients: int, client_port: int | None,
         pattern: str | None) -> None:
    """Print the median round trip per client for each message pattern, repetitions interleaved."""
    if serve_port is not None:
        serve(serve_port, clients)
        return
    if client_port is not None:
        click.echo(f"{client(client_port, pattern, rounds):.1f}")
        return
    for rep in range(reps):
        for name in PATTERNS:
            medians = _run_pattern(name, rounds)
            click.echo(f"rep {rep + 1} {name:9s} median round per client: " + ", ".join(f"{m:.0f} µs" for m in medians))


if __name__ == "__main__":
    main()
