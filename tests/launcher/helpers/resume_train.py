"""Test helper: deterministic training that checkpoints every $COMMIT_EVERY steps and resumes.

Usage: resume_train.py OUTDIR. Keys: a small one, a big one split across the servers
(PSLAUNCH_BIGARRAY_BOUND below its size), an embedding table. The optimizer is SGD with momentum
(state on the servers). Each step every worker pushes a gradient computed from the weights it
pulled, rounded to multiples of 1/64 so that any order of summing gives the same bits; the weights
after the last step are written by worker 0 to OUTDIR/final.npz, the step it resumed from and the checkpoint's id to
OUTDIR/resumed.<attempt>.<rank>, and what the checkpoint directory held then to
OUTDIR/listing.<attempt>.json.

COMMIT_WAIT=1: every commit waits until the checkpoint is complete (``commit(wait=True)``).

Faults, each on attempt $FAULT_ATTEMPT only (PSLAUNCH_RESTART_COUNT; "any": every attempt), at step
$FAULT_STEP, by worker $FAULT_RANK:
  FAULT=raise        the worker raises (exit 1 with a traceback)
  FAULT=exit         the worker exits with code 10 + the attempt number
  FAULT=kill-server  the worker SIGKILLs server $FAULT_SERVER
  FAULT=torn         worker 0 SIGKILLs server $FAULT_SERVER in the commit of step $FAULT_STEP, after the
                     servers wrote their files and before the manifest (a torn checkpoint)
"""

import json
import os
import signal
import sys

import numpy as np

import kvcore

out = sys.argv[1]
steps = int(os.environ.get("STEPS", "60"))
every = int(os.environ.get("COMMIT_EVERY", "5"))
wait = os.environ.get("COMMIT_WAIT") == "1"
attempt = int(os.environ.get("PSLAUNCH_RESTART_COUNT", "0"))
fault = os.environ.get("FAULT", "")
fault_attempt = os.environ.get("FAULT_ATTEMPT", "0")
fault_here = fault and fault_attempt in ("any", str(attempt))
fault_step = int(os.environ.get("FAULT_STEP", "37"))
fault_rank = int(os.environ.get("FAULT_RANK", "1"))

kv = kvcore.create(os.environ.get("STORE", "dist_sync"))
rng = np.random.default_rng(7)
shapes = {0: (4, 3), 1: (3000,), 2: (50, 8)}
keys = list(shapes)
kv.init(keys, [np.round(rng.standard_normal(s) * 64).astype(np.float32) / 64 for s in shapes.values()])
kv.set_optimizer(kvcore.optim.SGD(learning_rate=0.25, momentum=0.5))
state = kvcore.elastic.State(kv, step=0, note="start")
state.restore()
with open(os.path.join(out, f"resumed.{attempt}.{kv.rank}"), "w") as fh:
    fh.write(f"{state.step} {state.checkpoint_id}\n")
ckpt_dir = os.environ.get("PSLAUNCH_CHECKPOINT_DIR")
if kv.rank == 0 and ckpt_dir and os.path.isdir(ckpt_dir):  # what the restore saw, for the test
    with open(os.path.join(out, f"listing.{attempt}.json"), "w") as fh:
        json.dump({d: sorted(os.listdir(os.path.join(ckpt_dir, d))) for d in sorted(os.listdir(ckpt_dir))}, fh)

if fault == "torn" and fault_here and kv.rank == 0:
    ask = kv._worker.checkpoint

    def checkpoint_then_die(bodies, future=None):
        body = next(iter(bodies.values()))
        if body["op"] == "commit" and body["manifest"]["scalars"]["step"] == fault_step:
            os.kill(kv._worker.servers[int(os.environ.get("FAULT_SERVER", "0"))].pid, signal.SIGKILL)
        return ask(bodies, future)

    kv._worker.checkpoint = checkpoint_then_die

outs = {k: np.empty(s, np.float32) for k, s in shapes.items()}
for k in keys:
    kv.pull(k, out=outs[k])
for step in range(state.step, steps):
    if fault_here and step == fault_step and kv.rank == fault_rank:
        if fault == "raise":
            raise RuntimeError(f"worker {kv.rank} fails at step {step}")
        if fault == "exit":
            sys.stdout.flush()
            os._exit(10 + attempt)
        if fault == "kill-server":
            os.kill(kv._worker.servers[int(os.environ.get("FAULT_SERVER", "0"))].pid, signal.SIGKILL)
    for k in keys:
        grad = np.round(outs[k] * 64) / 64 * np.float32(0.5) + np.float32((step % 7 - 3) / 8 + kv.rank / 16)
        kv.push(k, grad.astype(np.float32))
    for k in keys:
        kv.pull(k, out=outs[k])
    state.step = step + 1
    state.note = f"after step {step}"
    if state.step % every == 0:
        state.commit(wait=wait)
kv.barrier()
if kv.rank == 0:
    for k in keys:
        kv.pull(k, out=outs[k])
    np.savez(os.path.join(out, "final.npz"), **{str(k): v for k, v in outs.items()})
print(f"worker {kv.rank} done at step {state.step}", flush=True)
