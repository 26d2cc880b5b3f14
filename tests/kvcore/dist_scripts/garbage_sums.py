"""Worker: exact sums over many rounds while the test throws garbage at the servers (waits for a go file)."""

import os
import sys
import time

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
kv.init([0, 1], [np.zeros(16, np.float32), np.zeros((300, 300), np.float32)])
if rank == 0:
    print("READY", flush=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
kv.barrier()
for i in range(20):
    kv.push([0, 1], [np.ones(16, np.float32) * (rank + 1), np.ones((300, 300), np.float32) * (rank + 1)])
    outs = [np.zeros(16, np.float32), np.zeros((300, 300), np.float32)]
    kv.pull([0, 1], out=outs)
    for o in outs:
        assert np.all(o == n * (n + 1) / 2), (i, o.ravel()[:4])
print("OK", rank, flush=True)
