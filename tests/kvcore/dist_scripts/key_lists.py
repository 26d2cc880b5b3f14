"""Worker: lists of many small keys (the servers' group fast path) stay exact when access patterns change."""

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
tri = n * (n + 1) / 2
keys = list(range(100, 140))
kv.init(keys, [np.zeros(3, np.float32) for _ in keys])


def pull_all(ks):
    outs = [np.zeros(3, np.float32) for _ in ks]
    kv.pull(ks, out=outs)
    return np.array([o[0] for o in outs])


for r in range(3):  # the same list every round
    kv.push(keys, [np.full(3, rank + 1 + r, np.float32) for _ in keys])
    assert np.all(pull_all(keys) == tri + n * r), (r, pull_all(keys))
kv.push(keys, [np.full(3, (rank + 1) * 10, np.float32) for _ in keys])  # two rounds before pulling
kv.push(keys, [np.full(3, (rank + 1) * 100, np.float32) for _ in keys])
assert np.all(pull_all(keys) == tri * 100), pull_all(keys)
kv.push(keys[5], np.full(3, 7, np.float32))  # one key alone: leaves the fast path
values = pull_all(keys)
assert values[5] == 7 * n and np.all(np.delete(values, 5) == tri * 100), values
single = np.zeros(3, np.float32)
kv.pull(keys[6], out=single)
assert np.all(single == tri * 100), single
for r in range(2):
    kv.push(keys, [np.full(3, rank + 1, np.float32) for _ in keys])
    assert np.all(pull_all(keys) == tri), pull_all(keys)
keys2 = list(range(200, 240))
kv.init(keys2, [np.ones(3, np.float32) for _ in keys2])
kv.set_optimizer(kvcore.optim.Test(rescale_grad=2))
for i in range(4):
    kv.push(keys2, [np.ones(3, np.float32) * (rank + 1) for _ in keys2])
    assert np.all(pull_all(keys2) == 1 + 2 * tri * (i + 1)), (i, pull_all(keys2))
kv.barrier()
print("OK", rank, flush=True)
