"""Workers init the keys of a model in calls of their own making, push ``rank + 1`` to every key
they share and check each pulled sum exactly; then the servers' bytes are read from ``--summary-json``
by the test. argv: ``MODE MODEL``.

MODE: ``one-call`` (every worker inits every key in one call), ``per-call-opposite`` (one key per
call; even ranks in the model's order, odd ranks in reverse), ``one-call-vs-per-call`` (worker 0
inits every key in one call, the others one key per call in reverse order), ``subset`` (the same,
but the others init only every other key).
MODEL: a name of ``testkit.model_shapes.MODELS`` (``ResNet-50``, ``BERT-base``, ``100 random keys``),
or ``ones:N`` (N one-element keys). Prints ``OK <rank>``.
"""

import sys

import numpy as np

import kvcore
from testkit.model_shapes import MODELS

MODE, MODEL = sys.argv[1], sys.argv[2]
shapes = [(1,)] * int(MODEL[5:]) if MODEL.startswith("ones:") else MODELS[MODEL]()
kv = kvcore.create("dist_sync")
rank, workers = kv.rank, kv.num_workers
keys = list(range(len(shapes)))
mine = keys if MODE != "subset" or rank == 0 else keys[::2]
if MODE == "one-call" or (MODE in ("subset", "one-call-vs-per-call") and rank == 0):
    kv.init(mine, [np.zeros(shapes[k], np.float32) for k in mine])
else:
    for k in (mine if rank % 2 == 0 and MODE == "per-call-opposite" else mine[::-1]):
        kv.init(k, np.zeros(shapes[k], np.float32))
shared = keys if MODE != "subset" else keys[::2]
kv.push(shared, [np.full(shapes[k], rank + 1, np.float32) for k in shared])
outs = [np.empty(shapes[k], np.float32) for k in shared]
kv.pull(shared, out=outs)
total = workers * (workers + 1) // 2
wrong = [k for k, out in zip(shared, outs) if not (out == total).all()]
assert not wrong, f"keys {wrong[:5]} do not hold the sum {total}: {[outs[shared.index(k)].ravel()[:3] for k in wrong[:5]]}"
print("OK", rank, flush=True)
