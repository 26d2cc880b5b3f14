"""Test helper: a dist_sync worker that pushes and pulls step after step; worker $RAISE_RANK raises
RuntimeError at step $RAISE_STEP (its own failure, with a traceback). The others go on until the
job breaks; they print nothing, so their last lines are what the runtime says."""

import os

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
kv.init(0, np.zeros(4, np.float32))
out = np.zeros(4, np.float32)
for step in range(int(os.environ.get("STEPS", "200"))):
    if kv.rank == int(os.environ["RAISE_RANK"]) and step == int(os.environ["RAISE_STEP"]):
        raise RuntimeError(f"worker {kv.rank} fails at step {step}")
    kv.push(0, np.ones(4, np.float32))
    kv.pull(0, out=out)
