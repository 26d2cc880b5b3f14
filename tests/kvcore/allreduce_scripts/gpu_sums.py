"""Worker: CuPy arrays summed over the workers, through NCCL (one GPU per worker) or host staging.

argv[1]: ``nccl`` (each worker on GPU ``local_rank``; float32 and int32 go through NCCL) or
``staged`` (every worker on GPU 0, int16: a dtype NCCL does not sum, so the host sums it). Exact
sums, on every worker, through kvcore.collectives and through the allreduce store.
"""

import sys

import numpy as np

import kvcore
from kvcore import arrays

mode = sys.argv[1]
kv = kvcore.create("allreduce")
rank, n = kv.rank, kv.num_workers
device = kvcore.gpu(kv.local_rank if mode == "nccl" else 0)
cp = arrays.cupy_module()
total = n * (n + 1) // 2
dtypes = [np.float32, np.int32] if mode == "nccl" else [np.int16]
with arrays.device_context(device):
    for dtype in dtypes:
        for size in (4, 300_001):
            value = cp.full(size, rank + 1, dtype=dtype)
            kvcore.collectives.allreduce(value)
            assert bool((value == total).all()), (mode, dtype, size, value[:4])
    kv.init("g", arrays.zeros((3, 4), dtypes[0], device))
    kv.push("g", cp.full((3, 4), rank + 1, dtype=dtypes[0]))
    out = arrays.zeros((3, 4), dtypes[0], device)
    kv.pull("g", out=out)
    assert bool((out == total).all()), out
print("OK", rank, flush=True)
