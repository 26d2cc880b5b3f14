"""Every worker inits keys of uneven sizes in its own order (with ``subset``, worker 1 passes only
every other key), pushes ones to the keys every worker passed and checks the sums: every worker
takes worker 0's placement of the keys it passed. Prints ``LAYOUT <rank> <json>`` (each key's parts
as ``[server, start, stop]``) and ``OK <rank>``."""

import json
import sys

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
sizes = {0: 50_000, 1: 400, 2: 30_000, 3: 20_000, 4: 9_000, 5: 7, 6: 3_000, 7: 12, 8: 100_000, 9: 64}
keys = list(sizes)
order = keys if kv.rank == 0 else list(reversed(keys))
if sys.argv[1:] == ["subset"] and kv.rank == 1:
    order = [k for k in order if k in keys[::2]]  # half the keys: worker 0's init is the one the servers take
kv.init(order, [np.full(sizes[k], 0.0, np.float32) for k in order])
common = keys[::2] if sys.argv[1:] == ["subset"] else keys
for k in common:
    kv.push(k, np.ones(sizes[k], np.float32))
for k in common:
    out = np.empty(sizes[k], np.float32)
    kv.pull(k, out=out)
    assert (out == kv.num_workers).all(), (k, out[:4])
layout = {str(k): [[p.server, p.start, p.stop] for p in kv.layout_for(k, (sizes[k],), np.float32).parts] for k in order}
print("LAYOUT", kv.rank, json.dumps(layout, sort_keys=True))
print("OK", kv.rank)
