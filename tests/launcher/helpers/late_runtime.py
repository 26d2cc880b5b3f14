"""Test helper: a worker whose runtime starts late, as one still importing its libraries (or a
replacement just started): it writes its pid to OUTDIR/pid.<rank>, waits until OUTDIR/go exists (at
most 60 s), then joins the job, pushes and pulls one key and prints OK <rank>.

Usage: late_runtime.py OUTDIR
"""

import os
import sys
import time

out = sys.argv[1]
rank = os.environ["DMLC_WORKER_ID"] if "DMLC_WORKER_ID" in os.environ else os.environ.get("PMI_RANK", "0")
with open(os.path.join(out, f"pid.{rank}.tmp"), "w") as fh:
    fh.write(str(os.getpid()))
os.replace(os.path.join(out, f"pid.{rank}.tmp"), os.path.join(out, f"pid.{rank}"))
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
print("OK", kv.rank, flush=True)
