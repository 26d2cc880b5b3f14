"""Worker of ``benchmarks.elastic``: each step every member pushes (rank + 1) to key 0 and pulls the sum
back (no optimizer: a round's value is the sum over that round's members), then waits $STEP_SLEEP
seconds. Appends ``rank step time value`` lines (``time.time()`` once the pull is done) to
OUTDIR/steps.<rank>.txt. With $JOINER=1 it first writes ``time.time()`` to OUTDIR/joiner.txt as it
registers (its imports done): a worker that joins the running job. Usage: elastic_worker.py OUTDIR."""

import os
import sys
import time

import numpy as np

import kvcore

out = sys.argv[1]
steps = int(os.environ.get("STEPS", "400"))
step_sleep = float(os.environ.get("STEP_SLEEP", "0.02"))
if os.environ.get("JOINER") == "1":
    with open(os.path.join(out, "joiner.txt"), "w") as fh:
        fh.write(f"{time.time():.6f}\n")
kv = kvcore.create("dist_sync")
rank = kv.rank
kv.init(0, np.zeros(1024, np.float32))
value = np.empty(1024, np.float32)
grad = np.full(1024, rank + 1, np.float32)
with open(os.path.join(out, f"steps.{rank}.txt"), "a") as log:
    for step in range(steps):
        kv.push(0, grad)
        kv.pull(0, out=value)
        log.write(f"{rank} {step} {time.time():.6f} {float(value[0])}\n")
        log.flush()
        time.sleep(step_sleep)
kv.close()
