"""Worker: dist_async refuses pushes without an optimizer, then applies every push exactly once."""

import numpy as np

import kvcore

kv = kvcore.create("dist_async")
rank, n = kv.rank, kv.num_workers
kv.init(1, np.zeros((3, 3), np.float32))
try:
    kv.push(1, np.ones((3, 3), np.float32))
except kvcore.OptimizerError as exc:
    assert "set_optimizer" in str(exc), exc
else:
    raise AssertionError("dist_async pushed without an optimizer")
kv.set_optimizer(kvcore.optim.Test(rescale_grad=1))
rounds = 20
handles = [kv.push(1, np.ones((3, 3), np.float32) * (rank + 1)) for _ in range(rounds)]
for h in handles:
    h.wait(30)
out = np.zeros((3, 3), np.float32)
kv.pull(1, out=out)
assert np.all(out >= rounds * (rank + 1)), out  # at least our own pushes are in
kv.barrier()
kv.pull(1, out=out)
assert np.all(out == rounds * n * (n + 1) / 2), out
print("OK", rank, flush=True)
