"""Worker: the barrier of all nodes holds workers and servers until the last arrives (worker 0 arrives
late and writes a marker); a worker is refused the servers' barrier and an unknown group, naming them."""

import os
import sys
import time

import numpy as np

import kvcore
from kvcore import runtime
from psnode.errors import PSNodeError

marker = sys.argv[1]
kv = kvcore.create("dist_sync")
node = runtime.worker()
if kv.rank == 0:
    time.sleep(0.5)
    with open(marker, "w") as fh:
        fh.write("worker 0 was here")
node.barrier("all")
assert os.path.exists(marker), f"worker {kv.rank} passed the barrier of all nodes before worker 0 reached it"
try:
    node.barrier("servers")
    raise AssertionError("a worker joined the servers' barrier")
except PSNodeError as exc:
    assert "not in the barrier group servers" in str(exc), exc
try:
    node.barrier("everyone")
    raise AssertionError("an unknown barrier group was accepted")
except ValueError as exc:
    assert "'everyone'" in str(exc) and "'all'" in str(exc), exc
kv.init(1, np.zeros(3, np.float32))
kv.push(1, np.ones(3, np.float32))
out = np.zeros(3, np.float32)
kv.pull(1, out=out)
assert np.all(out == kv.num_workers), out
kv.barrier()
print("OK", kv.rank, flush=True)
