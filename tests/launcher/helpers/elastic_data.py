"""Test helper: an elastic job's data, split by ``SplitSampler.elastic_batches`` while workers join and
leave. Each step a member takes its batch of indices of a dataset of $LENGTH (default 90), pushes
how many it took and which (a one-hot count per index, key 0), and logs them. With no optimizer a
round's value sums the members' pushes, so the test checks that every index of every epoch was
taken exactly once, by the step's members only.

Usage: elastic_data.py OUTDIR. $EPOCHS (default 3), $BATCH per member (default 4), $STEP_SLEEP,
$LEAVE ``rank:step`` as elastic_join.py. Appends ``rank epoch step members total i,j,...`` lines to
OUTDIR/data.<rank>.<pid>.txt (``rank epoch step members taken-by-all indices``).
"""

import os
import signal
import sys
import time

import numpy as np
from leave_plan import leave_step

import kvcore

out = sys.argv[1]
length = int(os.environ.get("LENGTH", "90"))
epochs = int(os.environ.get("EPOCHS", "3"))
batch = int(os.environ.get("BATCH", "4"))
step_sleep = float(os.environ.get("STEP_SLEEP", "0"))

kv = kvcore.create("dist_sync")
rank = kv.rank
kv.init(0, np.zeros(length, np.float32))
state = kvcore.elastic.State(kv, epoch=0, seen=0, step=0)
state.restore()
leave_at = leave_step(rank, state.step)
sampler = kvcore.SplitSampler(length, seed=7)
counts = np.empty(length, np.float32)
with open(os.path.join(out, f"data.{rank}.{os.getpid()}.txt"), "a") as log:
    for indices in sampler.elastic_batches(kv, state, batch):
        if state.epoch >= epochs:
            break
        time.sleep(step_sleep)
        epoch, step, members = state.epoch, state.step, kv.num_workers
        onehot = np.zeros(length, np.float32)
        onehot[indices] = 1
        kv.push(0, onehot)
        kv.pull(0, out=counts)
        log.write(f"{rank} {epoch} {step} {members} {int(counts.sum())} {','.join(map(str, indices.tolist()))}\n")
        log.flush()
        state.step = step + 1
        if step == leave_at:
            os.kill(os.getpid(), signal.SIGTERM)
kv.close()
