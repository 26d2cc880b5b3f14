"""Worker 1 inits key 'ghost', which worker 0 never inits: it waits for worker 0 to place it, and
then fails naming the key. ``timeout``: worker 0 goes on (a barrier), and worker 1's wait ends after
``PSLAUNCH_PLACEMENT_TIMEOUT``; ``finished``: worker 0 finishes first, and worker 1 is told at once
that the key will never come. Either way a key worker 0 did init still works. Prints ``OK <rank>``."""

import sys

import numpy as np

import kvcore

MODE = sys.argv[1]
kv = kvcore.create("dist_sync")
kv.init("real", np.arange(3, dtype=np.float32))
if kv.rank == 0:
    if MODE == "finished":
        kv.close()
    else:
        kv.barrier()
else:
    expected = kvcore.DistTimeoutError if MODE == "timeout" else kvcore.DistributedError
    words = "PSLAUNCH_PLACEMENT_TIMEOUT" if MODE == "timeout" else "worker 0 finished without initialising key 'ghost'"
    try:
        kv.init("ghost", np.zeros(2, np.float32))
    except expected as exc:
        assert "'ghost'" in str(exc) and words in str(exc), exc
    else:
        raise AssertionError("init of a key worker 0 never placed returned")
    if MODE == "timeout":
        out = np.zeros(3, np.float32)
        kv.pull("real", out=out)
        assert out.tolist() == [0, 1, 2], out
        kv.barrier()
print("OK", kv.rank)
