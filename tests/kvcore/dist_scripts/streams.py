"""Worker: exact dist_sync sums over the worker's streams to its servers (psnode.transport.streams):
small keys, a list of 300 one-float keys, a 1 MiB key (read into memory of its own), a key split
over both servers; worker 0 first sends each server's stream port (and Unix socket, on one host) a
stranger's bytes and a handshake without the key. Prints ``STREAMS <servers with a stream> <sent>
<received>``, ``FAMILIES <each stream's socket family>`` and ``OK <rank>``."""

import socket

import numpy as np
from stranger import knock

import kvcore
from psnode.transport.streams import MAGIC

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
worker = kv._worker
transport = worker.conn.transport
shapes = {1: (4,), 2: (300, 100), 3: (512, 512), 4: (700, 700)}  # 16 B, 117 KiB, 1 MiB, 1.9 MiB split
small = list(range(100, 400))
for key, shape in shapes.items():
    kv.init(key, np.zeros(shape, np.float32))
kv.init(small, [np.zeros(1, np.float32) for _ in small])

if rank == 0:  # a stranger's bytes: refused by each server before a byte is kept, the job goes on
    for server in worker.conn.members.servers:
        if server.stream_port:
            knock(server.host, server.stream_port, server.uid, MAGIC)
        if server.stream_socket:
            knock(server.host, 0, server.uid, MAGIC, unix=server.stream_socket)

total = sum(range(1, n + 1))
for rnd in range(5):
    for key, shape in shapes.items():
        value = np.full(shape, (rank + 1) * (rnd + 1), np.float32)
        value.reshape(-1)[::97] += rank  # not one constant: a byte in the wrong place would show
        kv.push(key, value)
        out = np.zeros(shape, np.float32)
        kv.pull(key, out=out)
        expected = np.full(shape, total * (rnd + 1), np.float32)
        expected.reshape(-1)[::97] += sum(range(n))
        assert np.array_equal(out, expected), (rnd, key, out.reshape(-1)[:4])
    outs = [np.zeros(1, np.float32) for _ in small]
    kv.push(small, [np.full(1, (rank + 1) * k, np.float32) for k in small])
    kv.pull(small, out=outs)
    assert [float(o[0]) for o in outs] == [float(total * k) for k in small], outs[:3]
streams = getattr(transport, "streams", {})
print("STREAMS", len(streams), sum(s.sent for s in streams.values()), sum(s.received for s in streams.values()),
      flush=True)
print("FAMILIES", " ".join(sorted(socket.AddressFamily(s.sock.family).name for s in streams.values())), flush=True)
kv.barrier()
print("OK", rank, flush=True)
