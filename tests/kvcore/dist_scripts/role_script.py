"""A user script started for every role (MXNet style): scheduler and server end inside `import kvcore`."""

import os

import numpy as np

import kvcore  # DMLC_ROLE=scheduler|server: runs that node here and exits 0 at job end

assert os.environ.get("DMLC_ROLE", "worker") == "worker", "a non-worker got past import kvcore"
kv = kvcore.create("dist_sync")
kv.init("w", np.ones(3, np.float32))
kv.push("w", np.ones(3, np.float32))
out = np.zeros(3, np.float32)
kv.pull("w", out=out)
assert np.all(out == kv.num_workers), out
print("OK", kv.rank, flush=True)
