"""Worker: asynchronous pushes with priorities in an order that differs by worker meet by key and version.

Worker 0 pushes a, b, c; the others c, b, a; then every worker pushes a again before any pull (two
pushes of one key in flight). Every pulled value is exact.
"""

import numpy as np

import kvcore

kv = kvcore.create("allreduce")
rank, n = kv.rank, kv.num_workers
keys = ["a", "b", "c"]
kv.init(keys, [np.zeros(400_000, np.int32), np.zeros(3, np.int32), np.zeros(70_000, np.int32)])
order = keys if rank == 0 else keys[::-1]
for step in range(3):
    handles = [kv.push(k, np.full(kv._meta[k].shape, rank + step + 1, np.int32), priority=-i)
               for i, k in enumerate(order)]
    handles += [kv.push("a", np.full(kv._meta["a"].shape, 1, np.int32))]  # twice before a pull
    for k in keys:
        out = np.zeros(kv._meta[k].shape, np.int32)
        kv.pull(k, out=out)
        expected = n if k == "a" else n * (n + 1) // 2 + n * step
        assert np.all(out == expected), (step, k, out[:3], expected)
print("OK", rank, flush=True)
