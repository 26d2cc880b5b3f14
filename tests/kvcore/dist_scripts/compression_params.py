"""Worker: a dist store checks set_gradient_compression's parameters as the device store does, keeps
them, and refuses compressed pushes, which do not travel to the servers yet, instead of sending
uncompressed ones."""

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank = kv.rank
for params, words in [
    ({"type": "2bit", "threshold": 0}, "greater than 0"),
    ({"type": "none"}, "Unknown type for gradient compression none"),
    ({"threshold": 0.5}, "no 'type'"),
    ({"type": "2bit", "threshold": "abc"}, "must be a number, got 'abc'"),
    ("2bit", "must be a dict"),
]:
    try:
        kv.set_gradient_compression(params)
    except kvcore.CompressionError as exc:
        assert words in str(exc), (params, exc)
    else:
        raise AssertionError(f"dist_sync accepted {params!r}")
kv.init(1, np.zeros(4, np.float32))
kv.push(1, np.ones(4, np.float32))  # before compression: an ordinary round
kv.set_gradient_compression({"type": "2bit", "threshold": 0.25})
assert kv._compression.params.threshold == np.float32(0.25)
try:
    kv.push(1, np.ones(4, np.float32))
except NotImplementedError as exc:
    assert "dist_sync cannot push with gradient compression yet (key 1)" in str(exc), exc
else:
    raise AssertionError("dist_sync pushed with compression on")
out = np.zeros(4, np.float32)
kv.pull(1, out=out)
assert out.tolist() == [kv.num_workers] * 4, out
print("OK", rank, flush=True)
