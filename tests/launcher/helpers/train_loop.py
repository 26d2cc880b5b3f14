"""A small training loop for the observability tests: rounds of push and pull on a few keys.

Every worker pushes and pulls key "w" (a 64 KiB value) and keys "k0".."k19" (as one list) each round,
then "computes" for STEP_SLEEP seconds; the worker whose rank is SLOW_RANK sleeps SLOW_SLEEP
seconds instead (a straggler). The loop runs for SECONDS seconds of wall time (at least ROUNDS
rounds), then checks the last pulled value and prints "done <rank> <rounds>".
"""

import os
import time

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank = kv.rank
seconds = float(os.environ.get("SECONDS_TO_RUN", "2"))
step = float(os.environ.get("STEP_SLEEP", "0.01"))
if str(rank) == os.environ.get("SLOW_RANK", ""):
    step = float(os.environ.get("SLOW_SLEEP", "0.2"))
small = [f"k{i}" for i in range(20)]
kv.init("w", np.zeros(16384, np.float32))
kv.init(small, [np.zeros(4, np.float32) for _ in small])
kv.init("stop", np.zeros(1, np.float32))
out = np.empty(16384, np.float32)
outs = [np.empty(4, np.float32) for _ in small]
stop = np.zeros(1, np.float32)
rounds = 0
end = time.monotonic() + seconds
least = int(os.environ.get("ROUNDS", "3"))
every = int(os.environ.get("PRINT_EVERY", "0"))
while not stop[0]:
    kv.push("w", np.ones(16384, np.float32))
    kv.pull("w", out=out)
    kv.push(small, [np.ones(4, np.float32) for _ in small])
    kv.pull(small, out=outs)
    rounds += 1
    if every and rounds % every == 0:
        print(f"round {rounds}: w[0] = {out[0]:g}", flush=True)
    over = rank == 0 and rounds >= least and time.monotonic() >= end
    kv.pushpull("stop", np.full(1, float(over), np.float32), out=stop)
    time.sleep(step)
assert float(out[0]) == kv.num_workers, out[0]
kv.barrier()
print(f"done {rank} {rounds}", flush=True)
