"""Worker of the bundled-runtime end-to-end tests: one push/pull, results to a file.

Every worker pushes ones * (rank + 1) to key 3; the pulled value must be the sum over workers,
n (n + 1) / 2. Writes OUTDIR/worker.<rank>.txt with "rank num_workers value". With $LOAD_SECONDS
it first sleeps that long, as a data load before kvcore.create would. The store is dist_sync, or
allreduce in a job without servers (the same script runs under -s N and -s 0).
"""

import os
import sys
import time

import numpy as np

import kvcore

out = sys.argv[1]
time.sleep(float(os.environ.get("LOAD_SECONDS", "0")))
kv = kvcore.create("allreduce" if os.environ.get("DMLC_NUM_SERVER") == "0" else "dist_sync")
kv.init(3, np.zeros((2, 3), np.float32))
kv.push(3, np.ones((2, 3), np.float32) * (kv.rank + 1))
result = np.empty((2, 3), np.float32)
kv.pull(3, out=result)
if hasattr(result, "wait"):
    result.wait()
with open(os.path.join(out, f"worker.{kv.rank}.txt"), "w") as fh:
    fh.write(f"{kv.rank} {kv.num_workers} {float(result.min())} {float(result.max())}\n")
print(f"worker {kv.rank} pulled {float(result.max())}", flush=True)
