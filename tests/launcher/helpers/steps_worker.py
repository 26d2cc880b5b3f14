"""Test helper: a dist_sync job that runs $STEPS steps of push and pull, $STEP_SLEEP seconds apart.

Imports kvcore first, so that with --command-for-all-roles the same script is the scheduler and
the servers too. Worker 0 prints "step N" every 10 steps and "done SUM" at the end (SUM: the last pulled value,
the sum of one push of ones per worker: the number of workers)."""

import os
import time

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
kv.init(0, np.zeros(2, np.float32))
out = np.zeros(2, np.float32)
steps = int(os.environ.get("STEPS", "50"))
for step in range(steps):
    kv.push(0, np.ones(2, np.float32))
    kv.pull(0, out=out)
    if kv.rank == 0 and step % 10 == 0:
        print(f"step {step}", flush=True)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
if kv.rank == 0:
    print(f"done {float(out[0]):g}", flush=True)
