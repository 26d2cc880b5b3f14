"""Worker: handle semantics — push copies, pull(wait=False) + callbacks, dist_device_sync merges device lists."""

import threading

import numpy as np

import kvcore

kv = kvcore.create("dist_device_sync")
rank, n = kv.rank, kv.num_workers
tri = n * (n + 1) / 2
kv.init([1, 2], [np.zeros(5, np.float32), np.zeros((700, 300), np.float32)])
small, big = np.full(5, rank + 1, np.float32), np.full((700, 300), rank + 1, np.float32)
h = kv.push([1, 2], [small, big])
assert isinstance(h, kvcore.Handle)
small[:] = -50  # the caller may change its arrays as soon as push returns
big[:] = -50
outs = [np.zeros(5, np.float32), np.zeros((700, 300), np.float32)]
seen = threading.Event()
handle = kv.pull([1, 2], out=outs, wait=False)
handle.add_done_callback(lambda done: seen.set())
handle.wait(60)
assert seen.wait(10), "the done callback did not run"
assert np.all(outs[0] == tri) and np.all(outs[1] == tri), (outs[0], outs[1][0, :3])
h.wait(60)
devices = [np.ones(5, np.float32), np.ones(5, np.float32) * 2]  # one value per device: summed on the worker
kv.push(1, devices)
out = np.zeros(5, np.float32)
kv.pull(1, out=[out, np.zeros(5, np.float32)])
assert np.all(out == 3 * n), out
kv.pushpull(1, np.ones(5, np.float32), out=out)
assert np.all(out == n), out
kv.barrier()
print("OK", rank, flush=True)
