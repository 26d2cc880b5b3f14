"""Test helper: ``kvcore.Trainer`` in an elastic job. Each step a member's gradient of w is the sum over
its batch of $BATCH samples of (rank + 1) each, and it steps with batch_size = $BATCH x kv.num_workers;
with SGD (learning rate 1, the optimizer in the store) w moves by minus the mean of (rank + 1) over
that step's members. $ON_STORE=0 keeps the optimizer in each worker (refused in an elastic job).
Keeps its step in a ``kvcore.elastic.State``, so a joiner goes on from the members' step (its
Trainer's first step takes the members' weights). Appends ``rank step members w0`` lines to
OUTDIR/trainer.<rank>.<pid>.txt.

Usage: elastic_trainer.py OUTDIR. $STEPS, $STEP_SLEEP, $LEAVE ``rank:step`` as elastic_join.py.
"""

import os
import signal
import sys
import time

import numpy as np
from leave_plan import leave_step

import kvcore

out = sys.argv[1]
steps = int(os.environ.get("STEPS", "30"))
batch = int(os.environ.get("BATCH", "2"))
step_sleep = float(os.environ.get("STEP_SLEEP", "0"))

kv = kvcore.create("dist_sync")
rank = kv.rank
w = np.zeros(4, np.float64)
trainer = kvcore.Trainer({"w": w}, kvcore.optim.SGD(learning_rate=1.0), kvstore=kv,
                         update_on_kvstore=os.environ.get("ON_STORE", "1") == "1")
state = kvcore.elastic.State(kv, step=0)
state.restore()
leave_at = leave_step(rank, state.step)
with open(os.path.join(out, f"trainer.{rank}.{os.getpid()}.txt"), "a") as log:
    for step in range(state.step, steps):
        time.sleep(step_sleep)
        members = kv.num_workers
        trainer.step(batch * members, {"w": np.full(4, float(batch * (rank + 1)))})
        log.write(f"{rank} {step} {members} {float(w[0])!r}\n")
        log.flush()
        state.step = step + 1
        if step == leave_at:
            os.kill(os.getpid(), signal.SIGTERM)
kv.close()
