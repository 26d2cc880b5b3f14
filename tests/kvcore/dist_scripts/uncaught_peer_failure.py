"""Worker: rank 1 raises after init; the others push and pull without catching what follows.

The survivors must end with the runtime's peer-failure exit code and one line naming worker 1,
after their exit handlers ran (they print ATEXIT).
"""

import atexit

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
# before init: worker 1's failure may reach a survivor while it still initialises
atexit.register(lambda: print(f"ATEXIT {kv.rank}", flush=True))
kv.init(0, np.zeros(4, np.float32))
if kv.rank == 1:
    raise RuntimeError("boom in worker 1")
for _ in range(1000):
    kv.push(0, np.ones(4, np.float32))
    kv.pull(0, out=np.zeros(4, np.float32))
print("NOT DIED", flush=True)
