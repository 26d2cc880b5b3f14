"""Worker: rank 1 raises after init; the others must fail with NodeDiedError naming worker 1."""

import sys

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
kv.init(0, np.zeros(4, np.float32))
if kv.rank == 1:
    raise RuntimeError("boom in worker 1")
try:
    kv.push(0, np.ones(4, np.float32))
    kv.pull(0, out=np.zeros(4, np.float32))
except kvcore.NodeDiedError as exc:
    print("DIED", exc.role, exc.rank, exc, flush=True)
    sys.exit(3)
print("NOT DIED", flush=True)
