"""Worker: a picklable user updater with init_key runs on the servers; split keys reach it as flat shards."""

import numpy as np
from custom_updater import ScaledAdd

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
kv.set_optimizer(ScaledAdd(3))
kv.init(["small", "big", "bad"], [np.zeros((3, 4), np.float32), np.zeros((600, 300), np.float32), np.zeros(2, np.float32)])
for i in range(2):
    kv.push(["small", "big"], [np.ones((3, 4), np.float32) * (rank + 1), np.ones((600, 300), np.float32)])
    small, big = np.zeros((3, 4), np.float32), np.zeros((600, 300), np.float32)
    kv.pull(["small", "big"], out=[small, big])
    assert np.all(small == 100 + 3 * n * (n + 1) / 2 * (i + 1)), small
    assert np.all(big == 100 + 3 * n * (i + 1)), big[0, :3]
kv.push("bad", np.ones(2, np.float32))
try:
    kv.pull("bad", out=np.zeros(2, np.float32))
except kvcore.ServerError as exc:
    assert "ValueError: this updater refuses key 'bad'" in str(exc), exc
    assert isinstance(exc, kvcore.DistributedError)
else:
    raise AssertionError("the updater's error did not reach the worker")
kv.barrier()
print("OK", rank, flush=True)
