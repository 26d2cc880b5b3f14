"""Worker: kvcore.collectives in a job without servers, every result exact.

allreduce of one array (in place, into an out, averaged, asynchronous), of a list (small arrays
fused), of shared arrays (``shared_empty``, reused across calls), allgather, broadcast,
broadcast_parameters of a dict with replicas, barrier.
"""

import numpy as np

from kvcore import collectives as C
from kvcore.trainer import Parameter

rank, n = C.rank(), C.num_workers()
total = n * (n + 1) // 2

a = np.full(5, rank + 1, np.int64)
assert C.allreduce(a) is a and np.all(a == total), a
out = np.zeros(5, np.int64)
C.allreduce(np.full(5, rank + 1, np.int64), out=out)
assert np.all(out == total), out
mean = C.allreduce(np.full(3, float(rank), np.float64), average=True)
assert np.allclose(mean, (n - 1) / 2), mean
handle = C.allreduce(np.full(2, 1.0, np.float32), key="async", wait=False)
assert np.all(handle.wait(10) == n)

arrays = [np.full(k + 1, rank + k, np.int32) for k in range(50)] + [np.full(300_000, rank, np.int32)]
C.allreduce(arrays)
assert all(np.all(x == total - n + n * k) for k, x in enumerate(arrays[:50])), arrays[0]
assert np.all(arrays[50] == total - n)

rows = C.allgather(np.array([rank, rank * 10], np.int64))
assert rows.tolist() == [[r, r * 10] for r in range(n)], rows

value = np.full(4, rank, np.float32)
C.broadcast(value, root=n - 1)
assert np.all(value == n - 1), value

params = {"w": [np.full((2, 3), rank, np.float32), np.full((2, 3), -1, np.float32)], "b": np.full(3, rank, np.int64)}
C.broadcast_parameters(params)
assert all(np.all(r == 0) for r in params["w"]) and np.all(params["b"] == 0), params
C.broadcast_parameters([Parameter("p", np.full(2, rank + 5.0))], root=1)

shared = C.shared_empty((3, 400_001), np.float32)  # big enough for the same-host path
assert shared.shape == (3, 400_001) and shared.dtype == np.float32
for step in range(3):  # reused at once after each call: the others have read it by then
    shared[:] = rank + step
    C.allreduce(shared)
    assert np.all(shared == total - n + n * step), (step, shared[0, :4])
tiny = C.shared_empty(4, np.int64)
tiny[:] = rank
assert np.all(C.allreduce(tiny) == total - n)

C.barrier()
print("OK", rank, flush=True)
