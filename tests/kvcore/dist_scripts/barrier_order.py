"""Worker: barrier() holds every worker until the last arrives (rank 0 arrives late and writes a marker)."""

import os
import sys
import time

import kvcore

kv = kvcore.create("dist_sync")
marker = sys.argv[1]
if kv.rank == 0:
    time.sleep(0.5)
    with open(marker, "w") as fh:
        fh.write("rank 0 was here")
kv.barrier()
assert os.path.exists(marker), f"worker {kv.rank} passed the barrier before rank 0 reached it"
kv.barrier()
print("OK", kv.rank, kv.num_workers, flush=True)
