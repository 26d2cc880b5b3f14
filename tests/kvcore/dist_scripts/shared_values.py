"""Worker: exact dist_sync values when the servers keep big values in memory the workers copy out
themselves (``psnode.server.shared_values``): keys of 2 MiB whole, 5.5 MiB split over the servers and
16 MiB in parts, pulled after each push, after two pushes in a row, and without waiting while the
next push goes out (each part then holds the value before that push or after its round); with
argv[1] ``optimizer`` the Test optimizer runs on the servers (it updates the stored value in place).
Prints ``SHARED <values copied out of a server's memory>`` and ``OK <rank>``."""

import sys

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
optimizer = sys.argv[1:] == ["optimizer"]
if optimizer:
    kv.set_optimizer(kvcore.optim.Test(rescale_grad=2))
shapes = {5: (512, 1024), 6: (1200, 1200), 8: (2048, 2048)}
for key, shape in shapes.items():
    kv.init(key, np.zeros(shape, np.float32))
held = {key: np.zeros(shape, np.float32) for key, shape in shapes.items()}  # what the servers hold


def value(shape, who, rnd):
    out = np.full(shape, (who + 1) * (rnd + 1), np.float32)
    out.reshape(-1)[::997] += who  # not one constant: a part in the wrong place would show
    return out


def push(key, rnd):
    """Push round ``rnd``'s value, then scribble on it (push copied it); track what the servers hold."""
    mine = value(shapes[key], rank, rnd)
    kv.push(key, mine)
    mine[...] = -7
    merged = sum(value(shapes[key], who, rnd) for who in range(n))
    held[key] = held[key] + 2 * merged if optimizer else merged


def check(key, out, when):
    assert np.array_equal(out, held[key]), (when, key, out.reshape(-1)[:3], held[key].reshape(-1)[:3])


rnd = 0
for _ in range(4):  # push, pull
    for key in shapes:
        push(key, rnd)
        out = np.zeros(shapes[key], np.float32)
        kv.pull(key, out=out)
        check(key, out, f"round {rnd}")
    rnd += 1
for key in shapes:  # two pushes, then one pull: it includes both rounds
    push(key, rnd)
    push(key, rnd + 1)
    out = np.zeros(shapes[key], np.float32)
    kv.pull(key, out=out)
    check(key, out, f"rounds {rnd} and {rnd + 1}")
rnd += 2
for key in shapes:  # a pull not waited for, the next round's push, then both
    before = held[key].copy()
    early = np.zeros(shapes[key], np.float32)
    handle = kv.pull(key, out=early, wait=False)
    push(key, rnd)
    handle.wait()
    # each server answers with the value it holds when it replies: before the push, or after the
    # round it closed meanwhile; never a value torn between the two
    for part in kv._layouts[key].parts:
        got = early.reshape(-1)[part.start:part.stop]
        assert (np.array_equal(got, before.reshape(-1)[part.start:part.stop])
                or np.array_equal(got, held[key].reshape(-1)[part.start:part.stop])), ("a pull before a push", key)
    out = np.zeros(shapes[key], np.float32)
    kv.pull(key, out=out)
    check(key, out, f"round {rnd}")
kv.barrier()
print("SHARED", kv._worker.requests.from_server_memory, flush=True)
print("OK", rank, flush=True)
