"""Worker: push/pull until the job breaks; prints READY once looping, then DIED <role> <rank> <seconds> <message>.

argv[1]: the keys' float32 count (default 8; big ones travel on data lanes over TCP)."""

import sys
import time

import numpy as np

import kvcore

size = int(sys.argv[1]) if len(sys.argv) > 1 else 8
kv = kvcore.create("dist_sync")
kv.init([0, 1], [np.zeros(size, np.float32), np.zeros(size, np.float32)])
deadline = time.monotonic() + 60
last_ok = time.monotonic()
rounds = 0
try:
    while time.monotonic() < deadline:
        kv.push([0, 1], [np.ones(size, np.float32)] * 2)
        kv.pull([0, 1], out=[np.zeros(size, np.float32), np.zeros(size, np.float32)])
        last_ok = time.monotonic()
        rounds += 1
        if rounds == 3:  # a few rounds through every server: the test may strike
            print("READY", flush=True)
        time.sleep(0.01)
except kvcore.NodeDiedError as exc:
    print(f"DIED {exc.role} {exc.rank} {time.monotonic() - last_ok:.2f} {exc}", flush=True)
    sys.exit(3)
print("NEVER FAILED", flush=True)
