"""Worker: exact dist_sync sums of values big enough for the data lanes, pushed copied and not
copied (``push(..., copy=False)``; a copied push's array changes as soon as push returns), with
worker 0 first sending the servers' data lane ports what a stranger would; prints ``LANES <sent>
<received> <in place> <written through>`` and ``OK <rank>``."""

import numpy as np
from stranger import knock

import kvcore
from psnode.transport.lanes import MAGIC

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
worker = kv._worker
# 2 MiB whole, 5.5 MiB split over the servers, 16 MiB in 4 parts (2 a server: a reply each), small
shapes = {5: (512, 1024), 6: (1200, 1200), 8: (2048, 2048), 7: (3, 4)}
for key, shape in shapes.items():
    kv.init(key, np.zeros(shape, np.float32))

if rank == 0:  # a stranger's bytes: refused by each server before a byte is kept, the job goes on
    for server in worker.conn.members.servers:
        if server.data_port:
            knock(server.host, server.data_port, server.uid, MAGIC)

total = sum(range(1, n + 1))
for rnd in range(4):
    copy = rnd % 2 == 0
    outs = {}
    for key, shape in shapes.items():
        value = np.full(shape, (rank + 1) * (rnd + 1), np.float32)
        value.reshape(-1)[::997] += rank  # not one constant: a part in the wrong place would show
        kv.push(key, value, copy=copy)
        if copy:  # the caller may change its array as soon as push returns, written through or copied
            value[...] = -7
        outs[key] = np.zeros(shape, np.float32)
        kv.pull(key, out=outs[key])
        expected = np.full(shape, total * (rnd + 1), np.float32)
        expected.reshape(-1)[::997] += sum(range(n))
        assert np.array_equal(outs[key], expected), (rnd, key, outs[key].reshape(-1)[:4])
        value[...] = -1  # the pull waited for the push: the value may change now
lanes = worker.conn.data_lanes
print("LANES", *((lanes.sent, lanes.received, lanes.in_place, lanes.written_through) if lanes else (0, 0, 0, 0)),
      flush=True)
kv.barrier()
print("OK", rank, flush=True)
