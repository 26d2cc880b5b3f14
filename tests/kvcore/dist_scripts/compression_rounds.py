"""Worker: dist_sync rounds with 2bit compression; prints ``DIGEST <key> <step> <sha256 prefix>`` of
every pulled value and ``OK <rank>``.

argv: ``kvcore|mxnet threshold``. Under kvcore (the test) each pull is also checked against a
reference made here: every worker's gradients quantized with their own residual by
``psnode.compression`` and the dequantized values summed in float32. Under MXNet 1.9.1's Python
(``mxnet``) the same pushes run through ``mx.kv.create('dist_sync')``: how the frozen digests in
test_dist_compression.py were made (see there).
"""

import sys

import numpy as np

from gradients import digest, make_grad

SYSTEM, THRESHOLD = sys.argv[1], sys.argv[2]
# key -> (size, values per push); 250_007 is split over the servers (the job's bigarray bound is 100000)
KEYS = {3: (1, 1), 4: (17, 1), 5: (1000, 2), 6: (250_007, 1)}
STEPS = 4

if SYSTEM == "mxnet":
    import mxnet as mx

    kv = mx.kv.create("dist_sync")
    array, host = mx.nd.array, (lambda a: a.asnumpy())
else:
    import kvcore

    kv = kvcore.create("dist_sync")
    array, host = (lambda a: a), (lambda a: a)
kv.set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
rank, workers = kv.rank, kv.num_workers
for key, (size, _) in KEYS.items():
    kv.init(key, array(np.zeros(size, np.float32)))


def grads(worker, key, step):
    size, count = KEYS[key]
    return [make_grad(size, 1000 * step + 100 * worker + 10 * key + i) for i in range(count)]


if SYSTEM != "mxnet":
    from psnode.compression import dequantize, quantize

    t = kv._compression.params.threshold
    residuals = {(w, k): np.zeros(KEYS[k][0], np.float32) for w in range(workers) for k in KEYS}

    def reference(key, step):
        """What every worker's push of ``key`` at ``step`` dequantizes to, summed in float32."""
        total = np.zeros(KEYS[key][0], np.float32)
        for w in range(workers):
            local = np.sum(grads(w, key, step), axis=0, dtype=np.float32)
            total += dequantize("2bit", quantize("2bit", local, residuals[(w, key)], t), t, size=local.size)
        return total

for step in range(STEPS):
    for key in KEYS:
        values = [array(g) for g in grads(rank, key, step)]
        kv.push(key, values[0] if len(values) == 1 else values)
    for key, (size, _) in KEYS.items():
        out = array(np.full(size, -7, np.float32))
        kv.pull(key, out=out)
        value = host(out)
        if SYSTEM != "mxnet":
            expected = reference(key, step)
            assert value.tobytes() == expected.tobytes(), (key, step, np.flatnonzero(value != expected)[:5])
        print("DIGEST", key, step, digest(value), flush=True)
print("OK", rank, flush=True)
