"""Worker: rank 1 pushes once and leaves; rank 0's push of a second round is acknowledged all the
same (argv[1]: the key's elements; 1 Mi of them travel in shared memory on one host; argv[2]
``after-finish``: rank 0 pushes once the server knows that rank 1 finished: a pull of another key,
which the server fails naming worker 1 only then), and its pull fails naming worker 1 instead of
hanging."""

import sys

import numpy as np

import kvcore

size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
kv = kvcore.create("dist_sync")
kv.init(3, np.zeros(size, np.float32))
kv.init(4, np.zeros(4, np.float32))  # the after-finish probe's key
out = np.zeros(size, np.float32)
kv.push(3, np.ones(size, np.float32))
kv.pull(3, out=out)
assert np.all(out == 2), out
if kv.rank == 1:
    print("OK", kv.rank, flush=True)
    sys.exit(0)
if sys.argv[2:] == ["after-finish"]:
    kv.push(4, np.ones(4, np.float32))
    try:  # answered only once the server knows that worker 1 finished: then with this error
        kv.pull(4, out=np.zeros(4, np.float32))
    except kvcore.ServerError as exc:
        assert "can never close" in str(exc) and "worker 1 on 127.0.0.1" in str(exc), exc
    else:
        raise AssertionError("the pull of a round nobody else will push returned")
kv.push(3, np.ones(size, np.float32)).wait()
try:
    kv.pull(3, out=out)
except kvcore.ServerError as exc:
    assert "can never close" in str(exc) and "worker 1 on 127.0.0.1" in str(exc), exc
    print("OK", kv.rank, flush=True)
else:
    raise AssertionError("the pull of a round nobody else will push returned")
