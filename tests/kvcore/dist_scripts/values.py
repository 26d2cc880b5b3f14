"""Worker: every dtype MXNet's KVStore allows sums exactly; zero-size keys work; other dtypes are refused
at init on every rank; a refused init raises the same error on every rank."""

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
dtypes = ["float16", "float32", "float64", "uint8", "int8", "int32", "int64"]
kv.init(dtypes, [np.zeros(5, d) for d in dtypes])
for step in range(1, 4):
    kv.push(dtypes, [np.full(5, rank + 1, d) for d in dtypes])
    outs = [np.empty(5, d) for d in dtypes]
    kv.pull(dtypes, out=outs)
    for d, out in zip(dtypes, outs):
        assert out.dtype == np.dtype(d) and out.tolist() == [n * (n + 1) // 2] * 5, (d, out)

kv.init("empty", np.zeros((0, 3), np.float32))
kv.push("empty", np.zeros((0, 3), np.float32))
empty = np.zeros((0, 3), np.float32)
kv.pull("empty", out=empty)
assert empty.shape == (0, 3)

for bad in (np.array([object(), 1], dtype=object), np.zeros(2, dtype="V8"), np.zeros(2, dtype=np.complex64)):
    try:
        kv.init(f"bad-{bad.dtype}", bad)
    except kvcore.DTypeMismatchError as exc:
        assert str(bad.dtype) in str(exc) and "float32" in str(exc), exc
    else:
        raise AssertionError(f"init of dtype {bad.dtype} was accepted")

# a second store of this process: its own key list, but the servers already hold key "again"
kv.init("again", np.zeros(2, np.float32))
other = kvcore.create("dist_sync")
try:
    other.init("again", np.ones(2, np.float32))
except kvcore.ServerError as exc:
    assert "already initialised" in str(exc), exc
    print("REFUSED", rank, str(exc), flush=True)
else:
    raise AssertionError("a refused init passed on rank %d" % rank)
print("OK", rank, flush=True)
