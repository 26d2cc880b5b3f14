"""A worker that times the ``allreduce`` store's ``push`` + ``pull`` of one big key: what
docs/benchmarks.md's A/B of keeping big keys in shared arrays ran. Start it under pslaunch, once per
checkout, alternating::

    pslaunch -n 2 -s 0 --env OMP_NUM_THREADS:1 benchmarks/store_push_worker.py      # MB=64 by default
    pslaunch -n 4 -s 0 --env OMP_NUM_THREADS:1 --env MB:4 benchmarks/store_push_worker.py

Worker 0 prints the median of 15 calls (after 3 untimed ones and a barrier); every worker checks
the sum it pulled.
"""

import os
import statistics
import sys
import time

import numpy as np

import kvcore


def main() -> int:
    kv = kvcore.create("allreduce")
    n = kv.num_workers
    size = (int(os.environ.get("MB", "64")) << 20) // 4
    kv.init("big", np.zeros(size, np.float32))
    value = np.ones(size, np.float32)
    out = np.empty(size, np.float32)
    for _ in range(3):
        kv.push("big", value)
        kv.pull("big", out=out)
    kv.barrier()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        kv.push("big", value)
        kv.pull("big", out=out)
        times.append(time.perf_counter() - start)
    if not np.all(out == n):
        print(f"worker {kv.rank}: pulled {out[:4]}, expected {n}", file=sys.stderr)
        return 1
    if kv.rank == 0:
        print(f"push+pull of {size * 4 >> 20} MiB, {n} workers: {statistics.median(times) * 1e3:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
