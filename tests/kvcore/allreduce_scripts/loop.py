"""Worker: allreduce in a loop until the job fails; prints the error it got (the dead worker names itself by rank)."""

import sys
import time

import numpy as np

import kvcore

kv = kvcore.create("allreduce")
print(f"READY {kv.rank}", flush=True)
value = np.ones(300_000, np.float32)
start = time.monotonic()
rounds = 0
try:
    while time.monotonic() - start < 120:
        kvcore.collectives.allreduce(value)
        value[:] = 1
        rounds += 1
        if rounds == 3:  # the test strikes once every worker is in the loop
            print(f"RUNNING {kv.rank}", flush=True)
except kvcore.NodeDiedError as exc:
    print(f"DIED rank={exc.rank} after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    sys.exit(3)
