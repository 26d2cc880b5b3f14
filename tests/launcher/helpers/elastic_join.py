"""Test helper for workers joining an elastic job: every step each member pushes (rank + 1) * (step + 1)
to keys 0 and 1 and pulls them back; with no optimizer a round's value is the sum over that round's
members, so each pulled value names the step's membership exactly. The script keeps its step in a
``kvcore.elastic.State``; a worker that joins the running job restores it (``state.restore()``) and
goes on from the members' step.

Usage: elastic_join.py OUTDIR. $STEPS steps (default 12), $STEP_SLEEP seconds in each (default 0).
$LEAVE lists ``rank:step`` or ``rank:+n`` items (``leave_plan``): that worker sends itself SIGTERM after
the pulls of that step, or of its n-th. $GATE, ``STEP:PATH``: before the push of step STEP each worker
waits until PATH exists (at most 60 s), and each writes OUTDIR/created.<rank>.<pid> once its store is
made (a test holds every round still while workers join).
Each worker appends ``rank step num_workers value0 value1`` lines (``kv.num_workers`` read as the step
begins) to OUTDIR/steps.<rank>.<pid>.txt,
``rank reset step num_workers`` to OUTDIR/resets.<rank>.txt at each change it sees, and
``rank joined step`` when it joined the running job.
"""

import os
import signal
import sys
import time

import numpy as np
from deadline import wait_until  # beside this script
from leave_plan import leave_step

import kvcore

out = sys.argv[1]
steps = int(os.environ.get("STEPS", "12"))
step_sleep = float(os.environ.get("STEP_SLEEP", "0"))

kv = kvcore.create("dist_sync")
rank = kv.rank
gate = os.environ.get("GATE")
gate_step, gate_path = (int(gate.split(":", 1)[0]), gate.split(":", 1)[1]) if gate else (-1, "")
if gate:
    open(os.path.join(out, f"created.{rank}.{os.getpid()}"), "w").close()
kv.init([0, 1], [np.zeros(4, np.float32), np.zeros(3, np.float32)])
state = kvcore.elastic.State(kv, step=0)
state.restore()
current = {"step": state.step}
leave_at = leave_step(rank, state.step)


def reset():
    with open(os.path.join(out, f"resets.{rank}.txt"), "a") as fh:
        fh.write(f"{rank} reset {current['step']} {kv.num_workers}\n")


state.register_reset_callbacks([reset])
values = [np.empty(4, np.float32), np.empty(3, np.float32)]
with open(os.path.join(out, f"steps.{rank}.{os.getpid()}.txt"), "a") as log:
    if kv.joined:
        log.write(f"{rank} joined {state.step}\n")
    for step in range(state.step, steps):
        time.sleep(step_sleep)
        current["step"] = step
        members = kv.num_workers  # this step's members (its step boundary: the reset callbacks run here)
        if step == gate_step:
            wait_until(lambda: os.path.exists(gate_path), f"worker {rank}: the gate {gate_path} opening", 60)
        kv.push([0, 1], [np.full(4, (rank + 1) * (step + 1), np.float32), np.full(3, (rank + 1) * (step + 1), np.float32)])
        kv.pull([0, 1], out=values)
        log.write(f"{rank} {step} {members} {float(values[0][0])} {float(values[1][-1])}\n")
        log.flush()
        state.step = step + 1
        if step == leave_at:
            os.kill(os.getpid(), signal.SIGTERM)
    log.write(f"{rank} done\n")
kv.close()
