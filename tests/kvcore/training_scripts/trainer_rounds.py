"""Worker: a Trainer on a distributed store with two replicas per worker; prints what it holds after each phase.

argv: ``store`` or ``worker`` (where the optimizer runs), then the store (``dist_sync`` by default,
or ``allreduce`` in a job without servers), and optionally a 2bit compression threshold
(``compression_params``) or a JSON compression dict (``compression=``). Worker r starts from weights 1 + r (rank 0's must win), and at step s its
replica j has the gradient (r + 1) * (j + 1) * (s + 1) everywhere.
"""

import json
import sys

import numpy as np

import kvcore

SHAPES = {"w": (3,), "big": (300, 400)}  # 120000 elements: split across servers with a bound of 100000

kv = kvcore.create(sys.argv[2] if len(sys.argv) > 2 else "dist_sync")
rank = kv.rank
params = {name: [np.full(shape, 1.0 + rank, np.float32) for _ in range(2)] for name, shape in SHAPES.items()}
given = sys.argv[3] if len(sys.argv) > 3 else None
compression = {"type": "2bit", "threshold": given} if given and not given.startswith("{") else None
trainer = kvcore.Trainer(params, kvcore.optim.SGD(learning_rate=0.5, momentum=0.5), kvstore=kv,
                         update_on_kvstore=sys.argv[1] == "store", compression_params=compression,
                         compression=json.loads(given) if given and given.startswith("{") else None)
trainer.sync_params()
print("SYNCED", rank, json.dumps({n: sorted({float(v) for r in reps for v in np.unique(r)}) for n, reps in params.items()}),
      flush=True)
for step in range(3):
    grads = {name: [np.full(shape, (rank + 1) * (j + 1) * (step + 1), np.float32) for j in range(2)]
             for name, shape in SHAPES.items()}
    trainer.step(4, grads)
    print("STEP", rank, step, json.dumps({n: sorted({float(v) for r in reps for v in np.unique(r)})
                                          for n, reps in params.items()}), flush=True)
print("OK", rank, flush=True)
