"""Test helper: a worker whose runtime starts late, as one still importing its libraries (or a
replacement just started): it says ``WAITING <pid>`` on stderr, waits until OUTDIR/go exists (at most
60 s), then joins the job, pushes and pulls one key and says OK <rank> on stderr.

Usage: late_runtime.py OUTDIR
"""

import os
import sys
import time

out = sys.argv[1]
print("WAITING", os.getpid(), file=sys.stderr, flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)

import numpy as np  # noqa: E402  (the runtime starts only now, on purpose)

import kvcore  # noqa: E402

kv = kvcore.create("dist_sync")
kv.init(0, np.zeros(3, np.float32))
kv.push(0, np.ones(3, np.float32))
value = np.empty(3, np.float32)
kv.pull(0, out=value)
assert value.tolist() == [float(kv.num_workers)] * 3, value
print("OK", kv.rank, file=sys.stderr, flush=True)
