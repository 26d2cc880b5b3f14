"""Worker: exact sums of small, split big and listed keys under dist_sync; prints OK <rank>."""

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
small, big = (3, 4), (1200, 1200)
kv.init(3, np.ones(small, np.float32))
kv.init(9, np.ones(big, np.float32))
keys = [20 + i for i in range(10)]
kv.init(keys, [np.full((i + 1,), i, np.float64) for i in range(10)])
total = n * (n + 1) / 2
for rnd in range(3):
    kv.push(3, np.ones(small, np.float32) * (rank + 1))
    kv.push(9, [np.ones(big, np.float32) * (rank + 1), np.ones(big, np.float32)])  # two devices: summed
    out, out_big = np.zeros(small, np.float32), np.zeros(big, np.float32)
    kv.pull(3, out=out)
    kv.pull(9, out=out_big)
    assert np.all(out == total), (rnd, out)
    assert np.all(out_big == total + n), (rnd, out_big[0, :4])
    kv.push(keys, [np.full((i + 1,), rank + rnd, np.float64) for i in range(10)])
    outs = [np.zeros((i + 1,), np.float64) for i in range(10)]
    kv.pull(keys, out=outs)
    for o in outs:
        assert np.all(o == sum(r + rnd for r in range(n))), (rnd, o)
    pp = np.ones(small, np.float32) * (rank + 1)
    kv.pushpull(3, pp)
    assert np.all(pp == total), pp
kv.barrier()
print("OK", rank, flush=True)
