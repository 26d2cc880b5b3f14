"""Worker: a dist store (argv[1]) with the compression of argv[2] (JSON: fp16, bf16, 1bit_scaled, topk,
randomk), checked against a reference (bit for bit; dist_async, where each push is added to the
weight as it arrives, in either order, to float32's rounding): every worker's gradients encoded here with a
residual of their own (per worker and key part) by ``kvcore.compression``'s scheme, decoded and
summed in float32 (two workers: a round's sum is the same in either arrival order), and pulls at
half width decoded from the sum's half-width bits. Keys: a small one, one split over the servers
(pushed as a list of two values), a row key; pushpull; a row_sparse_pull; the refusals (float16 and
row-sparse pushes). Prints OK <rank>.
"""

import json
import sys

import numpy as np
from gradients import make_grad, refused

import kvcore
from kvcore.compression import parse_params
from psnode.compression.schemes import from_half, to_half

STORE, PARAMS = sys.argv[1], json.loads(sys.argv[2])
kv = kvcore.create(STORE)
rank, workers = kv.rank, kv.num_workers
assert workers == 2, workers
sync = STORE != "dist_async"
kv.set_gradient_compression(PARAMS)
params = parse_params(PARAMS)
if not sync:
    kv.set_optimizer(kvcore.optim.Test(rescale_grad=1))  # weight += each push
SHAPES = {"small": (10,), "split": (250_007,), "rows": (4000, 30)}  # the job's bigarray bound is 100000
for key, shape in SHAPES.items():
    kv.init(key, np.zeros(shape, np.float32))
kv.init("half", np.zeros(4, np.float16))
parts = {key: [(p.start, p.stop) for p in kv.layout_for(key, shape, np.float32).parts] for key, shape in SHAPES.items()}
assert len(parts["split"]) == 2, parts

refused(lambda: kv.push("half", np.ones(4, np.float16)), kvcore.DTypeMismatchError, "only supported for float32")
sparse = kvcore.RowSparseArray((4000, 30), np.float32, np.array([3]), np.ones((1, 30), np.float32))
refused(lambda: kv.push("rows", sparse), kvcore.CompressionError, "row-sparse", "'rows'")

schemes = [params.scheme(stream=w) for w in range(workers)]  # each worker's own draws (randomk)
residuals: dict = {}


def grad(worker, key, step, i=0):
    return make_grad(int(np.prod(SHAPES[key])), 1000 * step + 100 * worker + 10 * len(key) + i).reshape(SHAPES[key])


def sent(worker, key, step, count):
    """What the servers decode from ``worker``'s push: its local reduce of ``count`` values, encoded part by part."""
    local = np.sum([grad(worker, key, step, i) for i in range(count)], axis=0, dtype=np.float32).reshape(-1)
    decoded = np.empty_like(local)
    for index, (start, stop) in enumerate(parts[key]):
        scheme = schemes[worker]
        residual = residuals.setdefault((worker, key, index), np.zeros(stop - start, np.float32))
        data = scheme.encode(local[start:stop], residual if scheme.keeps_residual else None)
        assert data.nbytes == scheme.encoded_nbytes(stop - start)
        decoded[start:stop] = scheme.decode(data, size=stop - start)
    return decoded.reshape(SHAPES[key])


def pulled(value):
    """What a pull gives of a stored float32 value: its half-width bits decoded, or the value itself."""
    if params.pull is None:
        return value
    return from_half(params.pull, to_half(params.pull, value.reshape(-1))).reshape(value.shape)


stored = {key: np.zeros(shape, np.float32) for key, shape in SHAPES.items()}
counts = {"split": 2, "rows": 1, "small": 1}
for step in range(4):
    handles = []
    for key in ("split", "rows"):  # the reference encodes in the order the store does: split, rows, small
        values = [grad(rank, key, step, i) for i in range(counts[key])]
        handles.append(kv.push(key, values if len(values) > 1 else values[0]))
    out = np.full(SHAPES["small"], -7, np.float32)
    if sync:
        handles.append(kv.pushpull("small", grad(rank, "small", step), out=out))
    else:
        handles.append(kv.push("small", grad(rank, "small", step)))
    for key in ("split", "rows", "small"):
        decoded = [sent(w, key, step, counts[key]) for w in range(workers)]
        stored[key] = (decoded[0] + decoded[1]).astype(np.float32) + (0 if sync else stored[key])
    for h in handles:
        h.wait(60)
    if sync:
        assert out.tobytes() == pulled(stored["small"]).tobytes(), (step, out, pulled(stored["small"]))
    else:
        kv.barrier()  # every worker's pushes of this step applied before anyone pulls
    for key, shape in SHAPES.items():
        out = np.full(shape, -7, np.float32)
        kv.pull(key, out=out)
        want = pulled(stored[key])
        if sync:
            assert out.tobytes() == want.tobytes(), (STORE, key, step, np.flatnonzero(out != want)[:5])
        else:
            rtol = 1e-5 if params.pull is None else 2**-7  # a sum rounded otherwise can round to the next half step
            assert np.allclose(out, want, rtol=rtol, atol=1e-6 * np.abs(want).max()), (key, step)
            want = out
        listed = [np.full(shape, -7, np.float32), np.full(shape, -7, np.float32)]  # a list of outs: each gets it
        kv.pull(key, out=listed)
        assert all(o.tobytes() == want.tobytes() for o in listed), (key, step)
    rows = np.array([0, 1999, 3999])
    dense = np.full(SHAPES["rows"], -7, np.float32)
    kv.row_sparse_pull("rows", out=dense, row_ids=rows)  # rows travel raw
    if sync:
        assert dense[rows].tobytes() == stored["rows"][rows].tobytes(), (step, dense[rows])
    else:
        kv.barrier()  # nobody pushes the next step before every worker pulled this one
print("OK", rank, flush=True)
