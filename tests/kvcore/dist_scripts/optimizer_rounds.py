"""Worker: the Test optimizer (rescale_grad=2) on the servers; every pull is exact for 7 rounds."""

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
kv.set_optimizer(kvcore.optim.Test(rescale_grad=2))
shapes = {5: (4, 5), 6: (1200, 1200)}
for key, shape in shapes.items():
    kv.init(key, np.ones(shape, np.float32))
for i in range(7):
    for key, shape in shapes.items():
        kv.push(key, np.ones(shape, np.float32) * (rank + 1))
    for key, shape in shapes.items():
        out = np.zeros(shape, np.float32)
        kv.pull(key, out=out)
        expected = 1 + 2 * n * (n + 1) / 2 * (i + 1)
        assert np.all(out == expected), (key, i, float(out.ravel()[0]), expected)
print("OK", rank, flush=True)
