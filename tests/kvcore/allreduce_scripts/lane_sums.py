"""Worker: ring allreduces between workers reached over TCP give exact sums, and say how many of
their messages came on lanes.

Prints ``LANE <port> <identity>`` (its lane port, and the identity a lane's opener names) first, then waits for the file ``argv[1]`` (a test attacks the
port meanwhile) before it sums.
"""

import os
import sys
import time

import numpy as np

from kvcore import collectives as C

node = C.group()._worker
print("LANE", node.conn.lanes.port if node.conn.lanes is not None else 0, node.conn.me.uid, flush=True)
deadline = time.monotonic() + 60
while len(sys.argv) > 1 and not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
n, rank = C.num_workers(), C.rank()
for size in (1, 300_001, 3_000_001):  # direct; a ring of one segment per chunk; several segments per chunk
    for dtype in (np.int32, np.int64):
        value = np.arange(size, dtype=dtype) * (rank + 1) - rank
        C.allreduce(value, key=("sums", size, np.dtype(dtype).name))
        expected = np.arange(size, dtype=dtype) * (n * (n + 1) // 2) - n * (n - 1) // 2
        assert np.array_equal(value, expected), (size, dtype, value[:3], expected[:3])
root = np.full(2_000_000, rank, np.float32)
C.broadcast(root, root=n - 1)
assert np.all(root == n - 1), root[:3]
rows = C.allgather(np.full(500_000, rank, np.int32))
assert all(np.all(rows[r] == r) for r in range(n)), rows[:, :3]
path = node.collectives.lane_path
print("OK", rank, "lane messages", path.received if path is not None else 0, flush=True)
