"""Benchmark worker: ``dist_sync`` push+pull rounds of one big key, with or without 2bit compression.

Run by ``benchmarks/compression_wire.py`` under the DMLC_* variables of a job, with kvcore's Python
(``kvcore``) or MXNet 1.9.1's (``mxnet``). argv: ``SYSTEM COMPRESSION NBYTES WARMUP ROUNDS`` with
COMPRESSION ``2bit`` or ``none``. Prints one ``RESULT`` line: each timed round's milliseconds (push
then pull of the key, until the pulled value is in ``out``) and the sha256 prefix of the last pulled
value, which the driver compares across systems (the same pushes give the same bits).

Each round pushes a new array (MXNet reuses a pushed CPU array as its receive buffer, so a pushed
array is overwritten by the next pull); the gradients are the same on both systems.
"""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np

import kv_suite

SYSTEM, COMPRESSION = sys.argv[1], sys.argv[2]
NBYTES, WARMUP, ROUNDS = (int(a) for a in sys.argv[3:6])
KEY = 7


def main() -> None:
    n = NBYTES // 4
    if SYSTEM == "mxnet":
        import mxnet as mx

        kv = mx.kv.create("dist_sync")
        wrap, host, version = mx.nd.array, (lambda a: a.asnumpy()), f"mxnet {mx.__version__}"

        def settle() -> None:
            mx.nd.waitall()  # MXNet's pull is asynchronous
    else:
        import kvcore

        kv = kvcore.create("dist_sync")
        wrap, host, version = (lambda a: a), (lambda a: a), "pslaunch"

        def settle() -> None:
            pass  # pull(wait=True) returns with the value in out

    if COMPRESSION != "none":
        kv.set_gradient_compression({"type": COMPRESSION, "threshold": 0.5})
    kv.init(KEY, wrap(np.zeros(n, np.float32)))
    rng = np.random.default_rng(kv.rank)
    grads = [rng.standard_normal(n, dtype=np.float32) for _ in range(2)]
    out = wrap(np.zeros(n, np.float32))
    barrier = getattr(kv, "barrier", None) or kv._barrier
    times = []
    for i in range(WARMUP + ROUNDS):
        value = wrap(grads[i % 2])  # a new array each round (see the module docstring)
        settle()
        barrier()
        start = time.perf_counter()
        kv.push(KEY, value)
        kv.pull(KEY, out=out)
        settle()
        if i >= WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    digest = hashlib.sha256(np.ascontiguousarray(host(out), np.float32).tobytes()).hexdigest()[:16]
    kv_suite.emit_result({"system": version, "rank": kv.rank, "times_ms": times, "digest": digest})


if __name__ == "__main__":
    main()
