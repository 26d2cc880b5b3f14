"""Benchmark worker: one step's communication of a model, through parameter servers or a ring.

Run by ``python -m benchmarks.ps_vs_ring`` under the DMLC_* variables of a job. argv: ``STORE MIB
TENSORS WARMUP ROUNDS`` with STORE ``dist_sync`` (servers) or ``allreduce`` (the ring, no servers).
The model is ``TENSORS`` float32 tensors of ``MIB`` MiB in all; a round is the push of every
tensor's gradient and the pull of every tensor, from a barrier until the last pulled value is in,
so it is what a training step spends communicating (no optimizer: the store sums). With servers each
tensor's pull leaves right after its push, as ``kvcore.Trainer`` sends a group's (a server answers
it once every worker's push of that tensor is in, while later tensors are still arriving). The ring
pushes every tensor, then pulls (a pull there waits for its tensor's sum). Every pull is
checked: worker ``r`` pushes ``r + 1`` everywhere, so the sum is ``W (W + 1) / 2`` (exact in
float32). Prints one ``RESULT <json>`` line: each timed round's seconds.
"""

from __future__ import annotations

import sys
import time

import kv_suite
import numpy as np

import kvcore

STORE = sys.argv[1]
MIB, TENSORS, WARMUP, ROUNDS = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])


def main() -> int:
    kv = kvcore.create(STORE)
    rank, workers = kv.rank, kv.num_workers
    n = int(MIB * (1 << 20)) // 4 // TENSORS
    keys = [f"t{i}" for i in range(TENSORS)]
    kv.init(keys, [np.zeros(n, np.float32) for _ in keys])
    grads = [np.full(n, rank + 1, np.float32) for _ in keys]
    outs = [np.empty(n, np.float32) for _ in keys]
    expected = np.float32(workers * (workers + 1) / 2)
    times = []
    for i in range(WARMUP + ROUNDS):
        kv.barrier()
        start = time.perf_counter()
        if STORE == "allreduce":
            kv.push(keys, grads)
            kv.pull(keys, out=outs)
        else:
            pulls = []
            for key, grad, out in zip(keys, grads, outs):
                kv.push(key, grad)
                pulls.append(kv.pull(key, out=out, wait=False))
            for pull in pulls:
                pull.wait()
        elapsed = time.perf_counter() - start
        if any(not np.all(out == expected) for out in outs):
            print(f"worker {rank}: round {i} pulled a wrong sum (expected {expected})", file=sys.stderr)
            return 1
        if i >= WARMUP:
            times.append(elapsed)
    kv_suite.emit_result({"rank": rank, "seconds": times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
