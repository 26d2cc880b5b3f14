"""A worker that times the TCP ring on its own: what docs/benchmarks.md's A/B of the message heap and
of the ring's segment size ran. Start it under pslaunch, once per setting, alternating::

    pslaunch -n 2 -s 0 --env PSLAUNCH_SAME_HOST:tcp --env OMP_NUM_THREADS:1 \\
        --env PSLAUNCH_MALLOC_TUNING:off benchmarks/ring_worker.py
    pslaunch -n 2 -s 0 --env PSLAUNCH_SAME_HOST:tcp --env OMP_NUM_THREADS:1 \\
        --env RING_SEGMENT_MAX:1048576 benchmarks/ring_worker.py      # 1 MiB segments, as before

Worker 0 prints, for an in-place float32 allreduce of 4 MiB (60 calls) and 64 MiB (12 calls), the
median time per call and its process's CPU (every thread) per call. ``RING_SEGMENT_MIN`` /
``RING_SEGMENT_MAX`` (bytes) replace the bounds of ``psnode.collectives.base.ring_segment``: an
experiment's knob, not a setting of pslaunch.
"""

import os
import statistics
import sys
import time

import numpy as np

import psnode.collectives.base as base

if os.environ.get("RING_SEGMENT_MIN"):
    base.SEGMENT = int(os.environ["RING_SEGMENT_MIN"])
if os.environ.get("RING_SEGMENT_MAX"):
    base.SEGMENT_MAX = int(os.environ["RING_SEGMENT_MAX"])

from kvcore import collectives  # noqa: E402  (after the knobs above)


def main() -> int:
    n = collectives.num_workers()
    for nbytes, calls in ((4 << 20, 60), (64 << 20, 12)):
        value = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            value[:] = 1
            collectives.allreduce(value, key="ring")
        collectives.barrier()
        times = []
        before = os.times()
        for _ in range(calls):
            start = time.perf_counter()
            value[:] = 1
            collectives.allreduce(value, key="ring")
            times.append(time.perf_counter() - start)
        after = os.times()
        if not np.all(value == n):
            print(f"worker {collectives.rank()}: the sum is {value[:4]}, expected {n}", file=sys.stderr)
            return 1
        cpu = (after.user + after.system - before.user - before.system) / calls
        if collectives.rank() == 0:
            print(f"{nbytes >> 20} MiB, {n} workers: {statistics.median(times) * 1e3:.2f} ms per allreduce, "
                  f"{cpu * 1e3:.1f} ms of CPU", flush=True)
        collectives.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
