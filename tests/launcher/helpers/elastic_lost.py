"""Test helper: an elastic job (``-n 2:3``) that loses worker 2 (SIGKILL, no leave) where its two
survivors stand at different places of their loop, as they may on a loaded host.

The loop is the digits example's (``SplitSampler.elastic_batches``: each step the members split the
next batch of the epoch, ``kv.num_workers`` of them), so survivors that disagreed on a step's members
would run different numbers of steps and the job would fail. Each step a member pushes ``rank + 1``
(key 0, no optimizer: a round's value is the sum over the workers that pushed to it) and pulls it.

The moment is pinned without sleeps: worker 2 kills itself after the pulls of step $LOST_AT (default
4) once worker 1 took the batch of the next step (``kv.num_workers`` read at its step boundary) and its
push of that step reached the server (OUTDIR/pushed.1); worker 0 takes its batch of that next step only
once the scheduler's word of the loss reached it (its book names rank 2 gone): it learns of the loss
before that step boundary, worker 1 after it.

Usage: elastic_lost.py OUTDIR. $LENGTH (default 60), $EPOCHS (default 2), $BATCH per member (default 2).
Appends ``rank epoch step members value`` lines to OUTDIR/lost.<rank>.txt, and ``rank done`` at the end.
"""

import os
import signal
import sys

import numpy as np
from deadline import wait_until  # beside this script

import kvcore

out = sys.argv[1]
length = int(os.environ.get("LENGTH", "60"))
epochs = int(os.environ.get("EPOCHS", "2"))
batch = int(os.environ.get("BATCH", "2"))
lost_at = int(os.environ.get("LOST_AT", "4"))
marker = os.path.join(out, "pushed.1")


kv = kvcore.create("dist_sync")
rank = kv.rank
kv.init(0, np.zeros(1, np.float32))
state = kvcore.elastic.State(kv, epoch=0, seen=0, step=0)
sampler = kvcore.SplitSampler(length, seed=7)
value = np.empty(1, np.float32)
with open(os.path.join(out, f"lost.{rank}.txt"), "a") as log:
    for indices in sampler.elastic_batches(kv, state, batch):
        if state.epoch >= epochs:
            break
        step = state.step
        epoch, members = state.epoch, kv.num_workers
        kv.push(0, np.full(1, rank + 1, np.float32))
        if rank == 1 and step == lost_at + 1:  # read its members and pushed: now worker 2 may go
            kv.wait_pushes()
            with open(marker, "w") as fh:
                fh.write("pushed\n")
        kv.pull(0, out=value)
        log.write(f"{rank} {epoch} {step} {members} {float(value[0])}\n")
        log.flush()
        state.step = step + 1
        if rank == 0 and step == lost_at:  # the scheduler's word of the loss comes before its next step boundary
            wait_until(lambda: 2 in kv._worker.conn.members.left, "worker 0: the loss of worker 2")
        if rank == 2 and step == lost_at:
            wait_until(lambda: os.path.exists(marker), "worker 2: worker 1's push of the next step")
            os.kill(os.getpid(), signal.SIGKILL)
    log.write(f"{rank} done\n")
kv.close()
