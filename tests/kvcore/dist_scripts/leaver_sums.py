"""Worker (argv: go-file): dist_async sums while the test attacks the job. Worker 0 initialises, ships the
optimizer and leaves at once (its identity is free from then on); the others wait for the go file,
push 20 rounds each and check the servers hold exactly the sum of their pushes."""

import os
import sys
import time

import numpy as np

import kvcore

kv = kvcore.create("dist_async")
rank, n = kv.rank, kv.num_workers
kv.init([0, 1], [np.zeros(16, np.float32), np.zeros((300, 300), np.float32)])
kv.set_optimizer(kvcore.optim.create("test", rescale_grad=1.0))
if rank == 0:
    print("LEAVING", flush=True)
    kv.close()
    sys.exit(0)
print("READY", rank, flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
for i in range(20):
    kv.push([0, 1], [np.ones(16, np.float32) * rank, np.ones((300, 300), np.float32) * rank])
expected = 20 * sum(range(1, n))  # every worker but 0, 20 pushes each
outs = [np.zeros(16, np.float32), np.zeros((300, 300), np.float32)]
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    kv.pull([0, 1], out=outs)
    if all(np.all(o == expected) for o in outs):
        break
    assert all(np.all(o <= expected) for o in outs), (expected, outs[0][:4])  # never more than was pushed
    time.sleep(0.05)
assert all(np.all(o == expected) for o in outs), (expected, outs[0][:4], outs[1].ravel()[:4])
print("OK", rank, flush=True)
