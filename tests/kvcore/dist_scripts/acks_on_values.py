"""Worker: pushes that leave on their own (no pull to ride with) are acknowledged on the next pull's
one-frame VALUE reply, and every pulled value is exact."""

import os
import time

import numpy as np

from testkit import use_recording_transport

os.environ["PSLAUNCH_TRANSPORT"] = use_recording_transport()  # the zmq transport, noting what arrives

import kvcore  # noqa: E402
from psnode.node.protocol import FLAG_ACKS, Cmd

kv = kvcore.create("dist_sync")
value, out = np.ones(4, np.float32), np.zeros(4, np.float32)
kv.init(3, value)
replies = kv._worker.conn.transport.received  # (command, flags) of every message this worker receives
for i in range(20):
    time.sleep(0.01)  # the network thread takes the receiving role back: the push is not held
    handle = kv.push(3, value * i)
    kv.pull(3, out=out)
    assert handle.done() and np.all(out == i * kv.num_workers), (i, out)
assert any(cmd == Cmd.VALUE and flags & FLAG_ACKS for cmd, flags in replies), replies
print("OK", kv.rank, flush=True)
