"""Test helper for a dist_sync worker replaced in place: a deterministic model whose gradients depend on
the weights, trained with SGD and momentum on the servers, while workers die and are replaced.

Usage: replace_sync.py OUTDIR. $STEPS steps (default 12). $KILLS lists where workers kill themselves
(SIGKILL, no chance to say goodbye): ``rank:step:phase`` items, comma-separated, each at most once (a
marker file in OUTDIR remembers it happened). The phases:

- ``compute``: after the step's gradients, before any push;
- ``push``: after pushing half of the keys;
- ``pushed``: after every push, before the pulls;
- ``pull``: after pulling half of the keys;
- ``pulled``: after the pulls, before the step is marked (``state.step = step + 1``);
- ``marked``: after the mark;
- ``barrier``: after the step's barrier ($BARRIER_EVERY > 0: ``kv.barrier()`` every that many steps);
- ``commit``: after the step's commit ($COMMIT_EVERY > 0: ``state.commit()`` every that many steps,
  which keeps nothing without a checkpoint directory);
- at step $STEPS, ``closed``: after ``kv.close()``, once the scheduler took the worker's finish;
- at step -1, the set-up: ``init`` (after ``kv.init``), ``optimizer`` (after ``set_optimizer``),
  ``restored`` (after ``state.restore()``), ``first-pull`` (after the pull of the weights).

$STEP_SLEEP seconds pass in each step's compute (default 0), so that a test can kill workers from
outside at random moments. With $NO_STATE=1 the script keeps no ``State``: it marks nothing. With
$OPTIMIZER_LATE=1 it sets the optimizer after restoring its scalars and pulling the weights, as a
``kvcore.Trainer`` does at its first step. $STORE is the store type (default ``dist_sync``).
$FAIL_AFTER_CLOSE=rank: that worker raises an error of its own after ``kv.close()``.
$STALL lists ``rank:step:phase:seconds`` items: that worker sleeps there that long (a stall).
With $PROGRESS=1 each worker appends each step it marked to OUTDIR/progress.<rank>.txt.

Keys: 0 is split over the servers (more than $PSLAUNCH_BIGARRAY_BOUND elements), the others whole.
Each step's gradient is a function of the weights the worker pulled, its rank and the step, so a
replacement that redid a step from other weights would end with other weights. Worker 0 writes
OUTDIR/weights.npz at the end; every worker appends "<rank> <restart count> <resumed step>" to
OUTDIR/starts.txt when it starts.
"""

import os
import signal
import sys
import time

import numpy as np

import kvcore

out = sys.argv[1]
steps = int(os.environ.get("STEPS", "12"))
kills = {item for item in os.environ.get("KILLS", "").split(",") if item}
barrier_every = int(os.environ.get("BARRIER_EVERY", "0"))
commit_every = int(os.environ.get("COMMIT_EVERY", "0"))
step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
no_state = os.environ.get("NO_STATE") == "1"
optimizer_late = os.environ.get("OPTIMIZER_LATE") == "1"
SHAPES = {0: (3000,), 1: (7,), 2: (64, 3), 3: (5,), 4: (1,)}


stalls = dict(item.rsplit(":", 1) for item in os.environ.get("STALL", "").split(",") if item)


def maybe_die(step: int, phase: str) -> None:
    point = f"{rank}:{step}:{phase}"
    if point in stalls:  # a worker that takes long here (data loading, a deadlock that ends)
        time.sleep(float(stalls[point]))
    marker = os.path.join(out, f"killed-{point.replace(':', '-')}")
    if point in kills and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


kv = kvcore.create(os.environ.get("STORE", "dist_sync"))
rank = kv.rank
keys = sorted(SHAPES)
kv.init(keys, [np.linspace(-1, 1, int(np.prod(SHAPES[k])), dtype=np.float32).reshape(SHAPES[k]) * (k + 1)
               for k in keys])
maybe_die(-1, "init")
if not optimizer_late:
    kv.set_optimizer(kvcore.optim.SGD(learning_rate=0.05, momentum=0.9))
    maybe_die(-1, "optimizer")

class NoState:
    step = 0

    def commit(self):
        pass

    def wait(self):
        pass


state = NoState() if no_state else kvcore.elastic.State(kv, step=0)
if not no_state:
    state.restore()
maybe_die(-1, "restored")
with open(os.path.join(out, "starts.txt"), "a") as fh:
    fh.write(f"{rank} {os.environ.get('PSLAUNCH_RESTART_COUNT', '0')} {state.step}\n")

weights = {k: np.empty(SHAPES[k], np.float32) for k in keys}
kv.pull(keys, out=[weights[k] for k in keys])
maybe_die(-1, "first-pull")
if optimizer_late:  # as kvcore.Trainer does, at its first step: after the scalars are restored
    kv.set_optimizer(kvcore.optim.SGD(learning_rate=0.05, momentum=0.9))
    maybe_die(-1, "optimizer")

for step in range(state.step, steps):
    grads = {k: (np.sin(weights[k] * (rank + 1) + step) * 0.1).astype(np.float32) for k in keys}
    if step_sleep:
        time.sleep(step_sleep)
    maybe_die(step, "compute")
    for i, k in enumerate(keys):
        kv.push(k, grads[k])
        if i == len(keys) // 2:
            maybe_die(step, "push")
    maybe_die(step, "pushed")
    for i, k in enumerate(keys):
        kv.pull(k, out=weights[k])
        if i == len(keys) // 2:
            maybe_die(step, "pull")
    maybe_die(step, "pulled")
    state.step = step + 1
    if os.environ.get("PROGRESS") == "1":
        with open(os.path.join(out, f"progress.{rank}.txt"), "a") as fh:
            fh.write(f"{step}\n")
    maybe_die(step, "marked")
    if barrier_every and state.step % barrier_every == 0:
        kv.barrier()
        maybe_die(step, "barrier")
    if commit_every and state.step % commit_every == 0:
        state.commit()
        maybe_die(step, "commit")

if commit_every:
    state.wait()
if rank == 0:
    np.savez(os.path.join(out, "weights.npz"), **{str(k): weights[k] for k in keys})
print(f"worker {rank} finished {steps} steps", flush=True)
kv.close()
maybe_die(steps, "closed")
if os.environ.get("FAIL_AFTER_CLOSE") == str(rank):
    raise RuntimeError(f"worker {rank} failed after its part was done")
