"""Worker: the allreduce store with the compression of argv[1] (JSON), checked bit for bit: every
worker's values encoded here with residuals of their own (per worker and key) by the scheme,
decoded and summed in rank order in float32, which is what every worker's store holds; a small
key, a big one, a key pushed as a list of two values, pushpull, several keys in one push, and the
refusals (a float16 key, a row-sparse push). Prints OK <rank>.
"""

import json
import sys

import numpy as np

import kvcore
from gradients import refused
from kvcore.compression import parse_params

PARAMS = json.loads(sys.argv[1])
kv = kvcore.create("allreduce")
rank, workers = kv.rank, kv.num_workers
kv.set_gradient_compression(PARAMS)
params = parse_params(PARAMS)
SHAPES = {"small": (10,), "big": (300_000,), "pair": (64, 33)}
for key, shape in SHAPES.items():
    kv.init(key, np.zeros(shape, np.float32))
kv.init("half", np.zeros(4, np.float16))
refused(lambda: kv.push("half", np.ones(4, np.float16)), kvcore.DTypeMismatchError, "only supported for float32")
sparse = kvcore.RowSparseArray((64, 33), np.float32, np.array([3]), np.ones((1, 33), np.float32))
refused(lambda: kv.push("pair", sparse), kvcore.CompressionError, "row-sparse", "'pair'")

schemes = [params.scheme(stream=w) for w in range(workers)]
residuals: dict = {}


def grad(worker, key, step, i=0):
    seed = 1000 * step + 100 * worker + 10 * len(key) + i
    return np.random.default_rng(seed).standard_normal(SHAPES[key]).astype(np.float32)


def decoded(worker, key, step, count):
    local = np.sum([grad(worker, key, step, i) for i in range(count)], axis=0, dtype=np.float32).reshape(-1)
    scheme = schemes[worker]
    residual = residuals.setdefault((worker, key), np.zeros(local.size, np.float32))
    return scheme.decode(scheme.encode(local, residual if scheme.keeps_residual else None), size=local.size)


counts = {"small": 1, "big": 1, "pair": 2}
for step in range(4):
    order = ["small", "big", "pair"]
    if step % 2:  # several keys in one push (one allgather), in the order the store encodes them
        kv.push(order[:2], [grad(rank, k, step) for k in order[:2]])
    else:
        out = np.empty(SHAPES["small"], np.float32)
        kv.pushpull("small", grad(rank, "small", step), out=out)
        kv.push("big", grad(rank, "big", step))
    kv.push("pair", [grad(rank, "pair", step, i) for i in range(2)])
    for key in order:
        want = decoded(0, key, step, counts[key])
        for w in range(1, workers):
            want += decoded(w, key, step, counts[key])
        out = np.full(SHAPES[key], -7, np.float32)
        kv.pull(key, out=out)
        assert out.reshape(-1).tobytes() == want.tobytes(), (key, step, np.flatnonzero(out.reshape(-1) != want)[:5])
print("OK", rank, flush=True)
