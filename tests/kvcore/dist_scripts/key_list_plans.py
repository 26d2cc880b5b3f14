"""Worker: a list of keys pushed and pulled every step with host arrays (``kvcore.stores.key_lists``):
exact sums, and after the list was seen, any call that differs (a value of another shape, dtype or
type, keys of another type, an out that is read-only or not contiguous, another list) is checked and
answered as the first time."""

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
tri = n * (n + 1) / 2
keys = list(range(300, 340))
kv.init(keys, [np.zeros(2, np.float32) for _ in keys])


def error_of(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what the user gets, whatever it is
        return type(exc).__name__, str(exc)
    return None


def bad_calls(ks):
    """Calls that must fail, each the same way before and after the list ``ks`` was seen."""
    good = [np.ones(2, np.float32) for _ in ks]
    wrong_shape = good[:3] + [np.ones(3, np.float32)] + good[4:]
    wrong_dtype = good[:3] + [np.ones(2, np.float64)] + good[4:]
    not_array = good[:3] + [[1.0, 2.0]] + good[4:]
    read_only = [np.zeros(2, np.float32) for _ in ks]
    read_only[7].flags.writeable = False
    return [
        lambda: kv.push(ks, wrong_shape),
        lambda: kv.push(ks, wrong_dtype),
        lambda: kv.push(ks, not_array),
        lambda: kv.push([float(k) for k in ks], good),
        lambda: kv.push(ks, good[:-1]),
        lambda: kv.pull(ks, out=wrong_dtype),
        lambda: kv.pull(ks, out=read_only),
    ]


before = [error_of(call) for call in bad_calls(keys)]
assert all(before), before  # each fails on the general path
assert before[-1][0] == "ReadOnlyOutError" and "key 307" in before[-1][1], before[-1]
for r in range(3):  # the same list every step: after the first, matched whole
    kv.push(keys, [np.full(2, rank + 1 + r, np.float32) for _ in keys])
    outs = [np.zeros(2, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    assert all(np.all(o == tri + n * r) for o in outs), (r, outs[:3])
after = [error_of(call) for call in bad_calls(keys)]
assert after == before, (before, after)
assert kv._key_lists.parts(keys, [np.ones(2, np.float32) for _ in keys]) is not None  # the list was matched whole

# the same list as a tuple, with a tuple of values; outs that are strided views get the value too
kv.push(tuple(keys), tuple(np.full(2, rank + 1, np.float32) for _ in keys))
wide = np.zeros((len(keys), 4), np.float32)
strided = [wide[i, ::2] for i in range(len(keys))]
kv.pull(keys, out=strided)
assert np.all(wide[:, ::2] == tri) and np.all(wide[:, 1::2] == 0), wide[:3]

# keys initialised after the list was seen: a list of old and new ones, then the old list again
more = list(range(400, 410))
kv.init(more, [np.zeros(2, np.float32) for _ in more])
mixed = keys[:5] + more
kv.push(mixed, [np.full(2, rank + 1, np.float32) for _ in mixed])
outs = [np.zeros(2, np.float32) for _ in mixed]
kv.pull(mixed, out=outs)
assert all(np.all(o == tri) for o in outs), outs
kv.push(keys, [np.full(2, 2 * (rank + 1), np.float32) for _ in keys])
outs = [np.zeros(2, np.float32) for _ in keys]
kv.pull(keys, out=outs)
assert all(np.all(o == 2 * tri) for o in outs), outs[:3]
kv.barrier()
print("OK", rank, flush=True)
