"""Worker: a dist store (argv[1]) with gradient compression, checked against a float32 reference:
pushes of a small key, a key split over the servers (on whole words) and a row key, pushpull, a
threshold change and a type change that keep the residuals, the errors. Prints OK <rank>.

The reference: every worker's gradients quantized here with a residual of their own (per worker
and key) by ``psnode.compression``, dequantized and summed in float32. dist_sync pulls a round's
sum; dist_async (the ``Test`` optimizer: ``weight += grad``) pulls every push added to the weight.
"""

import sys

import numpy as np

import kvcore
from gradients import make_grad, refused
from psnode.compression import dequantize, quantize

STORE = sys.argv[1]
kv = kvcore.create(STORE)
rank, workers = kv.rank, kv.num_workers
sync = STORE != "dist_async"

for params, words in [({"type": "2bit", "threshold": -1}, "greater than 0"),
                      ({"type": "none"}, "Unknown type for gradient compression none"), ("2bit", "must be a dict")]:
    try:
        kv.set_gradient_compression(params)
    except kvcore.CompressionError as exc:
        assert words in str(exc), (params, exc)
    else:
        raise AssertionError(f"{STORE} accepted {params!r}")

kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
SHAPES = {"small": (10,), "split": (250_007,), "rows": (4000, 30)}  # the job's bigarray bound is 100000
for key, shape in SHAPES.items():
    kv.init(key, np.zeros(shape, np.float32))
kv.init("half", np.zeros(4, np.float16))
for key in ("split", "rows"):  # split on whole 2bit words: every part but the last holds 16k values
    parts = kv.layout_for(key, SHAPES[key], np.float32).parts
    assert len(parts) > 1 and all(p.start % 16 == 0 for p in parts), (key, parts)
assert kv.layout_for("rows", SHAPES["rows"], np.float32).row_size == 30  # on rows that are word boundaries too: row pulls stay per server
if not sync:
    kv.set_optimizer(kvcore.optim.Test(rescale_grad=1))

refused(lambda: kv.push("half", np.ones(4, np.float16)), kvcore.DTypeMismatchError, "only supported for float32")

kind, t = "2bit", np.float32(0.5)
residuals = {(w, key): np.zeros(shape, np.float32).reshape(-1) for w in range(workers) for key, shape in SHAPES.items()}
stored = {key: np.zeros(shape, np.float32) for key, shape in SHAPES.items()}


def grad(worker, key, step, i=0):
    return make_grad(int(np.prod(SHAPES[key])), 1000 * step + 100 * worker + 10 * len(key) + i).reshape(SHAPES[key])


def sent(worker, key, step, count):
    """What the servers decode from ``worker``'s push: its local reduce of ``count`` values, quantized."""
    local = np.sum([grad(worker, key, step, i) for i in range(count)], axis=0, dtype=np.float32).reshape(-1)
    packed = quantize(kind, local, residuals[(worker, key)], t)
    assert packed.nbytes == 4 * -(-local.size // (16 if kind == "2bit" else 32))  # what travels: 16x / 32x smaller
    return dequantize(kind, packed, t, size=local.size).reshape(SHAPES[key])


handles = []
for step in range(6):
    if step == 2:  # a new threshold; residuals are kept
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.25})
        t = np.float32(0.25)
    if step == 4:  # another type; residuals are kept too
        kv.set_gradient_compression({"type": "1bit", "threshold": 0})
        kind, t = "1bit", np.float32(0)
    counts = {"small": 1, "split": 2, "rows": 1}
    for key in ("split", "rows"):
        values = [grad(rank, key, step, i) for i in range(counts[key])]
        handles.append(kv.push(key, values if len(values) > 1 else values[0]))
    mine = grad(rank, "small", step)
    out = np.full(SHAPES["small"], -7, np.float32)
    handles.append(kv.pushpull("small", mine, out=out))  # the push half is compressed
    for key, count in counts.items():
        rounds = sum(sent(w, key, step, count) for w in range(workers)).astype(np.float32)
        stored[key] = rounds if sync else stored[key] + rounds
    for h in handles:
        h.wait(60)
    if not sync:  # every worker's pushes of this step applied before anyone pulls
        kv.barrier()
    else:
        assert out.tobytes() == stored["small"].tobytes(), (step, out, stored["small"])
    for key, shape in SHAPES.items():
        out = np.full(shape, -7, np.float32)
        kv.pull(key, out=out)
        assert out.tobytes() == stored[key].tobytes(), (STORE, key, step, np.flatnonzero(out != stored[key])[:5])
    rows = np.array([0, 1999, 3999])
    dense = np.full(SHAPES["rows"], -7, np.float32)
    kv.row_sparse_pull("rows", out=dense, row_ids=rows)
    assert dense[rows].tobytes() == stored["rows"][rows].tobytes(), (step, dense[rows])
    if not sync:
        kv.barrier()  # nobody pushes the next step before every worker pulled this one
print("OK", rank, flush=True)
