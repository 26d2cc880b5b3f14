"""Worker: the last worker initialises a key with another shape; every worker raises WorkerMismatchError."""

import numpy as np

import kvcore

kv = kvcore.create("allreduce")
rank, n = kv.rank, kv.num_workers
try:
    kv.init("w", np.zeros(4 if rank < n - 1 else 5, np.float32))
except kvcore.WorkerMismatchError as exc:
    print(f"MISMATCH {rank}: {exc}", flush=True)
else:
    raise SystemExit(f"worker {rank}: init of different shapes did not fail")
# the job goes on: the next collective works
a = kvcore.collectives.allreduce(np.ones(3, np.int64))
assert np.all(a == n), a
print("OK", rank, flush=True)
