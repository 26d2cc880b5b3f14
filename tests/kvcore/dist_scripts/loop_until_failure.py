"""Worker: push/pull until the job breaks; prints READY once looping, then DIED <role> <rank> <seconds> <message>."""

import sys
import time

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
kv.init([0, 1], [np.zeros(8, np.float32), np.zeros(8, np.float32)])
deadline = time.monotonic() + 60
last_ok = time.monotonic()
rounds = 0
try:
    while time.monotonic() < deadline:
        kv.push([0, 1], [np.ones(8, np.float32)] * 2)
        kv.pull([0, 1], out=[np.zeros(8, np.float32), np.zeros(8, np.float32)])
        last_ok = time.monotonic()
        rounds += 1
        if rounds == 3:  # a few rounds through every server: the test may strike
            print("READY", flush=True)
        time.sleep(0.01)
except kvcore.NodeDiedError as exc:
    print(f"DIED {exc.role} {exc.rank} {time.monotonic() - last_ok:.2f} {exc}", flush=True)
    sys.exit(3)
print("NEVER FAILED", flush=True)
