"""Raw pyzmq DEALER/ROUTER figures: the ceiling the pslaunch transport is measured against.

One ROUTER process (standing in for the server) and N DEALER processes (standing in for the workers)
run the same shapes as the KVStore suite, over a TCP or an ipc endpoint:

- ``echo_<bytes>``: a dealer sends a frame of that size and the router sends the same frame back
  (``copy=False`` both ways, received as zero-copy ``np.frombuffer`` views): the transport-only
  analogue of one push+pull round; figures are per dealer, with all dealers running at once.
- ``echo_16``: the same with 16 bytes (four float32): the floor for a small key's round trip.
- ``oneway_<bytes>``: a dealer streams frames to the router, which acknowledges the last one:
  one-way throughput per dealer.

usage: ``zmq_ceiling.py router ENDPOINT NUM_DEALERS`` and ``zmq_ceiling.py dealer ENDPOINT PLAN_JSON``.
Each dealer prints one ``RESULT`` line; every receive has a timeout, so a lost peer ends the run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import zmq

__all__ = ["serve", "measure"]

RESULT_PREFIX = "RESULT "
IDLE_TIMEOUT_MS = 60_000  # a router or dealer that hears nothing for this long gives up

_BARRIER, _ECHO, _STREAM, _FINISH, _QUIT = b"B", b"E", b"S", b"F", b"Q"


def serve(endpoint: str, num_dealers: int) -> None:
    """Run the router until every dealer has said it is done (or nothing arrives for a minute)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.rcvtimeo = IDLE_TIMEOUT_MS
    sock.bind(endpoint)
    waiting: list[bytes] = []
    streamed: dict[bytes, int] = {}
    done = 0
    try:
        while done < num_dealers:
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                raise SystemExit(f"zmq_ceiling router on {endpoint}: no message for {IDLE_TIMEOUT_MS / 1e3:.0f} s")
            ident, cmd = frames[0].bytes, frames[1].bytes
            if cmd == _ECHO:
                sock.send_multipart([ident, _ECHO, frames[2]], copy=False)
            elif cmd == _STREAM:
                # a zero-copy view, as a server would read a pushed array
                streamed[ident] = streamed.get(ident, 0) + np.frombuffer(frames[2].buffer, dtype=np.uint8).nbytes
            elif cmd == _FINISH:
                sock.send_multipart([ident, _FINISH, str(streamed.pop(ident, 0)).encode()])
            elif cmd == _BARRIER:
                waiting.append(ident)
                if len(waiting) == num_dealers:
                    for peer in waiting:
                        sock.send_multipart([peer, _BARRIER])
                    waiting.clear()
            elif cmd == _QUIT:
                done += 1
    finally:
        sock.close(linger=0)
        ctx.term()


class _Dealer:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvtimeo = IDLE_TIMEOUT_MS
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def recv(self) -> list[zmq.Frame]:
        try:
            return self.sock.recv_multipart(copy=False)
        except zmq.Again:
            raise SystemExit(f"zmq_ceiling dealer: no reply from {self.endpoint} for {IDLE_TIMEOUT_MS / 1e3:.0f} s")

    def barrier(self) -> None:
        self.sock.send(_BARRIER)
        self.recv()

    def echo_rounds(self, nbytes: int, warmup: int, rounds: int) -> list[float]:
        buf = np.ones(max(nbytes // 4, 1), dtype=np.float32)
        times = []
        clock = time.perf_counter
        for i in range(warmup + rounds):
            t = clock()
            self.sock.send_multipart([_ECHO, buf], copy=False)
            reply = self.recv()
            np.frombuffer(reply[1].buffer, dtype=np.float32)
            if i >= warmup:
                times.append(clock() - t)
        return times

    def oneway(self, nbytes: int, frames: int) -> float:
        buf = np.ones(nbytes // 4, dtype=np.float32)
        t = time.perf_counter()
        for _ in range(frames):
            self.sock.send_multipart([_STREAM, buf], copy=False)
        self.sock.send(_FINISH)
        received = int(self.recv()[1].bytes)
        elapsed = time.perf_counter() - t
        if received != nbytes * frames:
            raise SystemExit(f"zmq_ceiling: router counted {received} bytes, {nbytes * frames} were sent")
        return nbytes * frames / elapsed

    def close(self) -> None:
        self.sock.send(_QUIT)
        self.sock.close(linger=1000)
        self.ctx.term()


def _summary(times: list[float], scale: float, unit: str) -> dict:
    s = sorted(times)
    return {"unit": unit, "rounds": len(s), "median": statistics.median(s) * scale,
            "mean": statistics.mean(s) * scale, "min": s[0] * scale}


def measure(endpoint: str, plan: dict) -> dict:
    """Run the dealer side of ``plan`` (the KV suite's sizes and round counts) and return the figures."""
    dealer = _Dealer(endpoint)
    measures: dict[str, dict] = {}
    try:
        dealer.barrier()
        for nbytes, rounds in zip(plan["sizes"], plan["big_rounds"]):
            if not rounds:
                continue
            dealer.barrier()
            times = dealer.echo_rounds(nbytes, plan["big_warmup"], rounds)
            summary = _summary(times, 1e3, "ms")
            summary["bytes_per_s"] = 2 * nbytes / (summary["median"] / 1e3)
            measures[f"echo_{nbytes}"] = summary
        if plan["small_rounds"]:
            dealer.barrier()
            measures["echo_16"] = _summary(dealer.echo_rounds(16, plan["small_warmup"], plan["small_rounds"]), 1e6, "us")
        for nbytes, rounds in zip(plan["sizes"], plan["big_rounds"]):
            if not rounds:
                continue
            dealer.barrier()
            dealer.oneway(nbytes, max(2, plan["big_warmup"]))
            measures[f"oneway_{nbytes}"] = {"unit": "B/s", "bytes_per_s": dealer.oneway(nbytes, max(rounds, 4))}
        dealer.barrier()
    finally:
        dealer.close()
    return {"system": f"pyzmq {zmq.__version__} libzmq {zmq.zmq_version()}", "measures": measures}


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in ("router", "dealer"):
        raise SystemExit(__doc__)
    if argv[0] == "router":
        serve(argv[1], int(argv[2]))
    else:
        result = measure(argv[1], json.loads(argv[2]))
        sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
