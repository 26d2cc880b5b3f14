"""Collectives in a job with servers: a worker's address book holds the servers only, and the
workers' addresses come from the scheduler on first use (PEERS). Worker 0 starts its collectives
last, so the others' first messages reach it before it knows them (they are held, then taken).
``allgather-first``: the first collective is an allgather, whose arguments are checked against the
job's size before the workers' addresses came. Prints ``OK <rank>``."""

import sys
import time

import numpy as np

import kvcore
from kvcore import collectives as C

kv = kvcore.create("dist_sync")
kv.init(0, np.zeros(4, np.float32))
kv.push(0, np.ones(4, np.float32))
out = np.empty(4, np.float32)
kv.pull(0, out=out)
assert (out == kv.num_workers).all(), out
if kv.rank == 0:
    time.sleep(0.5)
if sys.argv[1:] == ["allgather-first"]:
    first = C.allgather(np.array([kv.rank * 10], np.int64))
    assert first.ravel().tolist() == [r * 10 for r in range(kv.num_workers)], first
total = C.allreduce(np.full(1000, kv.rank + 1, np.float32))
assert (total == sum(range(1, kv.num_workers + 1))).all(), total[:4]
rows = C.allgather(np.array([kv.rank], np.int64))
assert rows.ravel().tolist() == list(range(kv.num_workers)), rows
print("OK", kv.rank)
