"""Worker: kvcore.elastic.State with Adam on the servers (a tuple of state arrays per key).

Usage: elastic_state.py OUTDIR PHASE. Every worker pushes gradients that are multiples of 1/64 (any
order of summing gives the same bits).

- ``save``: 3 steps, commit (scalars epoch=3, note, history), a 4th step; worker 0 writes the
  weights after step 4 to OUTDIR/saved.npz.
- ``restore-first`` / ``init-first``: restore before / after ``kv.init`` (with zeros), check the
  scalars, do step 4; worker 0 writes OUTDIR/<phase>-<servers>.npz.
- ``mismatch``: restore, then init key 0 with another shape: prints ``MISMATCH <message>``.
- ``no-dir``: (no checkpoint directory) commit returns None with a warning, restore finds nothing.
- ``sync-fails``: commit 1 (waited for); worker 0 takes the final name of server 1's file of
  checkpoint 2 (a directory there), so that server cannot rename its synced file into place; commit
  2 returns its id, and ``wait()`` raises on every worker: prints ``FAILED <message>``. Commit 3
  then completes (``wait=True``).
"""

import os
import sys
import warnings

import numpy as np

import kvcore

out, phase = sys.argv[1], sys.argv[2]
kv = kvcore.create("dist_sync")
rank = kv.rank
shapes = {0: (4, 3), 1: (3000,)}


def init():
    start = np.random.default_rng(3)
    kv.init(list(shapes), [np.round(start.standard_normal(s) * 64).astype(np.float32) / 64 for s in shapes.values()])


def step(i):
    for key, shape in shapes.items():
        kv.push(key, np.full(shape, (i % 3 - 1) / 8 + rank / 64, np.float32))
    for key, shape in shapes.items():
        kv.pull(key, out=np.empty(shape, np.float32))


def weights():
    result = {}
    for key, shape in shapes.items():
        result[str(key)] = np.empty(shape, np.float32)
        kv.pull(key, out=result[str(key)])
    return result


if phase == "no-dir":
    init()
    state = kvcore.elastic.State(kv, epoch=0)
    assert state.restore() is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert state.commit() is None
    print("WARNED", caught[0].message, flush=True)
    print("OK", rank, flush=True)
    sys.exit(0)

if phase == "sync-fails":
    init()
    state = kvcore.elastic.State(kv, step=0)
    state.step = 1
    assert state.commit(wait=True) == 1
    if rank == 0:
        os.makedirs(os.path.join(os.environ["PSLAUNCH_CHECKPOINT_DIR"], "ckpt-00000002", "server-1-of-2.bin", "taken"))
    kv.barrier()
    step(0)
    state.step = 2
    assert state.commit() == 2  # returns once the files are written; completing it fails later
    try:
        state.wait()
    except kvcore.CheckpointError as exc:
        print("FAILED", exc, flush=True)
    else:
        sys.exit("wait() returned for a checkpoint whose file could not be renamed into place")
    step(1)
    state.step = 3
    assert state.commit(wait=True) == 3 and state.wait() == 3
    print("OK", rank, flush=True)
    sys.exit(0)

if phase not in ("restore-first", "mismatch"):
    init()
kv.set_optimizer(kvcore.optim.Adam(learning_rate=0.125))
state = kvcore.elastic.State(kv, epoch=0, note="", history=[])
if phase == "save":
    assert state.restore() is False
    for i in range(3):
        step(i)
    state.epoch, state.note, state.history = 3, "after three", [1, 2.5, "x"]
    print("COMMITTED", state.commit(), flush=True)
    step(3)
    if rank == 0:
        np.savez(os.path.join(out, "saved.npz"), **weights())
    kv.barrier()
    print("OK", rank, flush=True)
    sys.exit(0)

assert state.restore() is True
assert (state.epoch, state.note, state.history, state.checkpoint_id) == (3, "after three", [1, 2.5, "x"], 1), state.scalars
if phase == "mismatch":
    try:
        kv.init(0, np.zeros((3, 4), np.float32))
    except kvcore.ShapeMismatchError as exc:
        print("MISMATCH", exc, flush=True)
        print("OK", rank, flush=True)
        sys.exit(0)
    sys.exit("init of a key of another shape than the checkpoint's went through")
if phase == "restore-first":
    kv.init(list(shapes), [np.zeros(s, np.float32) for s in shapes.values()])
step(3)
if rank == 0:
    np.savez(os.path.join(out, f"{phase}-{kv.num_servers}.npz"), **weights())
kv.barrier()
print("OK", rank, flush=True)
