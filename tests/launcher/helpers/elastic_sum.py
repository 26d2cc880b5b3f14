"""Test helper for an elastic job (``-n MIN:MAX``): every step each member pushes (rank + 1) * (step + 1)
to key 0 and pulls it back; with no optimizer a round's value is the sum over that round's members,
so each pulled value names the step's membership exactly.

Usage: elastic_sum.py OUTDIR. $STEPS steps (default 12), $STEP_SLEEP seconds in each (default 0).
$LEAVE lists ``rank:step`` items: that worker sends itself SIGTERM after the pulls of that step (it
then leaves at its next push). $OWN_TERMS=1: a worker that got SIGTERM ends the loop itself once
``kv.leaving`` says so, and calls ``kv.close()`` after $CLOSE_SLEEP seconds. $BARRIER=1: every step
starts with ``kv.barrier()``. With $RESETS=1 the script keeps a ``kvcore.elastic.State`` whose reset
callback appends ``rank reset step num_workers`` to OUTDIR/resets.<rank>.txt. Each worker appends ``rank step num_workers value``
lines to OUTDIR/steps.<rank>.txt, and ``rank done`` once its loop ended.
"""

import os
import signal
import sys
import time

import numpy as np
from leave_plan import leave_step

import kvcore

out = sys.argv[1]
steps = int(os.environ.get("STEPS", "12"))
step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
own_terms = os.environ.get("OWN_TERMS") == "1"
barrier = os.environ.get("BARRIER") == "1"

kv = kvcore.create("dist_sync")
rank = kv.rank
kv.init(0, np.zeros(4, np.float32))
current = {"step": 0}
leave_at = leave_step(rank, 0)
if os.environ.get("RESETS") == "1":
    state = kvcore.elastic.State(kv, step=0)

    def reset():
        with open(os.path.join(out, f"resets.{rank}.txt"), "a") as fh:
            fh.write(f"{rank} reset {current['step']} {kv.num_workers}\n")

    state.register_reset_callbacks([reset])
value = np.empty(4, np.float32)
with open(os.path.join(out, f"steps.{rank}.txt"), "a") as log:
    for step in range(steps):
        if own_terms and kv.leaving:
            break
        if barrier:
            kv.barrier()
        time.sleep(step_sleep)
        current["step"] = step
        members = kv.num_workers  # this step's members (its step boundary)
        kv.push(0, np.full(4, (rank + 1) * (step + 1), np.float32))
        kv.pull(0, out=value)
        log.write(f"{rank} {step} {members} {float(value[0])}\n")
        log.flush()
        if step == leave_at:
            os.kill(os.getpid(), signal.SIGTERM)
    log.write(f"{rank} done\n")
time.sleep(float(os.environ.get("CLOSE_SLEEP", "0")) if kv.leaving else 0)
kv.close()
