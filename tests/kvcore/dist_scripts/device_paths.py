"""Worker (argv: cpu|gpu): dist_device_sync with values on the devices, the SGD optimizer on the
servers' shards there (PSLAUNCH_SERVER_DEVICE), pulls into strided and other-device targets, row
pulls, and a dist_async key; every value exact, and every part asserts where it ran."""

import sys

import numpy as np

import kvcore
from kvcore import arrays
from device_updater import DeviceCheckingUpdater

gpu = sys.argv[1] == "gpu"
kv = kvcore.create("dist_device_sync")
rank, n = kv.rank, kv.num_workers
if gpu:
    devices = [arrays.gpu(i % arrays.num_gpus()) for i in range(2)]
    assert all(d.is_gpu for d in devices), arrays.gpu_status()
else:
    devices = [arrays.cpu(), arrays.cpu()]
lr = 0.5
kv.set_updater(DeviceCheckingUpdater(kvcore.optim.SGD(learning_rate=lr), gpu))
shapes = {"small": (4, 5), "split": (1000, 300)}  # "split" spans both servers (bound 100000)
for key, shape in shapes.items():
    kv.init(key, np.ones(shape, np.float32))
pushed = sum(rank_ + 1 + i for rank_ in range(n) for i in range(len(devices)))  # per step, all workers
for step in range(3):
    for key, shape in shapes.items():
        values = [arrays.to_device(np.full(shape, rank + 1 + i, np.float32), d) for i, d in enumerate(devices)]
        kv.push(key, values)
        with arrays.device_context(devices[1]):
            wide = arrays.zeros((shape[0], 2 * shape[1]), np.float32, devices[1])
        host = np.zeros(shape, np.float32)
        kv.pull(key, out=[wide[:, ::2], host])  # a strided target on the second device, a host one
        expected = 1 - lr * pushed * (step + 1)
        assert np.all(arrays.asnumpy(wide[:, ::2]) == expected), (key, step, float(arrays.asnumpy(wide).max()), expected)
        assert not arrays.asnumpy(wide[:, 1::2]).any(), key
        assert np.all(host == expected), (key, step, float(host.max()), expected)
for key in shapes:
    buffer = kv._merge_buffers.get(key)  # dist_device_sync sums a list of GPU values on its first GPU
    assert (arrays.device_of(buffer) == devices[0]) if gpu else buffer is None, (key, buffer)

# row pulls: the servers gather the rows where they keep the shard; the index lands on out's device
rows = np.array([999, 0, 3, 3], dtype=np.int64)
dense = arrays.zeros(shapes["split"], np.float32, devices[1])
kv.row_sparse_pull("split", out=dense, row_ids=arrays.to_device(rows, devices[0]))
expected = np.zeros(shapes["split"], np.float32)
expected[[0, 3, 999]] = 1 - lr * pushed * 3
assert np.array_equal(arrays.asnumpy(dense), expected), arrays.asnumpy(dense)[:4, :4]
kv.barrier()

# dist_async: every push applied on arrival by the same checking updater
kva = kvcore.create("dist_async")
kva.set_updater(DeviceCheckingUpdater(kvcore.optim.SGD(learning_rate=lr), gpu))
kva.init("async", np.zeros((3, 3), np.float32))
handles = [kva.push("async", arrays.to_device(np.full((3, 3), rank + 1, np.float32), devices[0])) for _ in range(5)]
for h in handles:
    h.wait(30)
kva.barrier()
out = arrays.zeros((3, 3), np.float32, devices[0])
kva.pull("async", out=out)
assert np.all(arrays.asnumpy(out) == -lr * 5 * n * (n + 1) / 2), arrays.asnumpy(out)
kva.barrier()
print("OK", rank, flush=True)
