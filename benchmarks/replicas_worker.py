"""Worker of ``benchmarks.replicas``: push+pull rounds of one key, timed.

Usage: replicas_worker.py OUT ROUNDS [PAUSE_S]. $SIZE elements of float32 (one key, split over the
servers when above ``PSLAUNCH_BIGARRAY_BOUND``). Each round pushes the key and pulls it back (the
pull waits for the round); after 3 warm-up rounds, the end of every round is written to
``OUT/rounds.<rank>`` as ``time.monotonic()`` seconds, one per line (the clock every process of the
machine shares). ``PAUSE_S`` seconds pass between rounds (0: none).
"""

import os
import sys
import time

import numpy as np

import kvcore

out, rounds = sys.argv[1], int(sys.argv[2])
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
size = int(os.environ.get("SIZE", str(1 << 20)))
kv = kvcore.create("dist_sync")
kv.init(0, np.zeros(size, np.float32))
grad = np.full(size, 1.0 / kv.num_workers, np.float32)
value = np.empty(size, np.float32)
stamps = []
for r in range(3 + rounds):
    kv.push(0, grad)
    kv.pull(0, out=value)
    if r >= 3:
        stamps.append(time.monotonic())
    if pause:
        time.sleep(pause)
# every worker added 1/num_workers per round: the sum replaced the value
assert abs(float(value[0]) - 1.0) < 1e-6, value[0]
with open(os.path.join(out, f"rounds.{kv.rank}"), "w") as fh:
    fh.write("\n".join(f"{t:.6f}" for t in stamps) + "\n")
