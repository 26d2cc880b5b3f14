"""Worker: rank 1 raises after init; the others must fail with NodeDiedError naming worker 1."""

import sys

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
if kv.rank == 1:
    kv.init(0, np.zeros(4, np.float32))
    raise RuntimeError("boom in worker 1")
try:  # the news may come while this worker's init still waits for the others' (a set-up barrier)
    kv.init(0, np.zeros(4, np.float32))
    kv.push(0, np.ones(4, np.float32))
    kv.pull(0, out=np.zeros(4, np.float32))
except kvcore.NodeDiedError as exc:
    print("DIED", exc.role, exc.rank, exc, flush=True)
    sys.exit(3)
print("NOT DIED", flush=True)
