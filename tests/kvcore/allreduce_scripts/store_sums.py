"""Worker: the allreduce store's KVStore semantics, with exact integer and float sums.

init broadcasts worker 0's values; push sums over every worker (a list summed locally first);
pull copies; pushpull sums in place; fused pushes of many small keys; an optimizer runs on every
worker and leaves identical weights; big keys take the same-host or ring path.
"""

import sys

import numpy as np

import kvcore

kv = kvcore.create("allreduce")
rank, n = kv.rank, kv.num_workers
assert kv.num_servers == 0 and kv.type == "allreduce"
total = n * (n + 1) // 2  # sum of rank + 1 over the workers

# init: worker 0's value wins
kv.init("w", np.full((3, 4), rank + 10, np.int64))
out = np.zeros((3, 4), np.int64)
kv.pull("w", out=out)
assert np.all(out == 10), out

# push of one value, of a list of values; pull after
for step in range(3):
    kv.push("w", np.full((3, 4), (rank + 1) * (step + 1), np.int64))
    kv.pull("w", out=out)
    assert np.all(out == total * (step + 1)), (step, out)
kv.push("w", [np.full((3, 4), rank + 1, np.int64), np.full((3, 4), 1, np.int64)])
kv.pull("w", out=out)
assert np.all(out == total + n), out

# pushpull in place and into an out
big = int(sys.argv[1]) if len(sys.argv) > 1 else 3_000_000
kv.init(["big", "small"], [np.zeros(big, np.int32), np.zeros(7, np.float64)])
value = np.arange(big, dtype=np.int32) * (rank + 1)
kv.pushpull("big", value)
assert np.array_equal(value, np.arange(big, dtype=np.int32) * total), value[:5]
small = np.full(7, rank + 0.5)
got = np.zeros(7)
kv.pushpull("small", small, out=got)
assert np.allclose(got, total - n / 2) and np.all(small == rank + 0.5), got
kv.pull("big", out=value)
assert np.array_equal(value, np.arange(big, dtype=np.int32) * total)
for step in range(3):  # push and pull through the key's own buffers, which big keys keep in shared memory
    kv.push("big", np.arange(big, dtype=np.int32) * (rank + 1) + step)
    kv.pull("big", out=value)
    assert np.array_equal(value, np.arange(big, dtype=np.int32) * total + n * step), (step, value[:5])
shared = kv.collectives._engine.shared
assert (shared.locate(kv._sums["big"].reshape(-1)) is not None) == (big * 4 >= 1 << 20), "big key's sum not shared"

# 1000 one-float keys pushed and pulled together (fused), twice
keys = [f"k{i}" for i in range(1000)]
kv.init(keys, [np.zeros(1, np.float32)] * 1000)
outs = [np.zeros(1, np.float32) for _ in keys]
for step in range(2):
    kv.push(keys, [np.full(1, rank + k + step, np.float32) for k in range(1000)])
    kv.pull(keys, out=outs)
    assert all(o[0] == total - n + n * (k + step) for k, o in enumerate(outs)), [o[0] for o in outs[:3]]

# an optimizer on every worker: identical weights everywhere
kv.set_optimizer(kvcore.optim.SGD(learning_rate=0.5))
kv.init("p", np.ones(5, np.float32))
kv.push("p", np.full(5, rank + 1, np.float32))
weights = np.zeros(5, np.float32)
kv.pull("p", out=weights)
assert np.allclose(weights, 1 - 0.5 * total), weights
rows = kv.collectives.allgather(weights)
assert all(np.array_equal(r, weights) for r in rows), rows
kv.barrier()
print("OK", rank, flush=True)
