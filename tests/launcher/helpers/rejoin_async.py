"""Test helper for --restart-scope worker: dist_async, where one worker fails and is started again alone.

Usage: rejoin_async.py OUTDIR. The worker of rank $FAIL_RANK (default 1) fails; the other steps.
Key 0 gets a push of ones from every step of every worker, key 1 counts the stepping worker's
steps, key 2 the failing one's (the Test optimizer adds each push exactly). The failing worker
pushes $DIE_AFTER steps and raises on its first start (PSLAUNCH_RESTART_COUNT 0); started again it
inits the keys again (which only learns where worker 0 placed them: the servers hold them) and
pushes $STEPS steps. The other goes on stepping the whole time, until key 2 shows the replacement
has finished, and then checks that key 0 holds every push of all three runs. It writes
OUTDIR/worker<its rank>.txt: "<its steps> <key 0> <expected> <its pid>".
"""

import os
import sys
import time

import numpy as np

import kvcore

out = sys.argv[1]
die_after = int(os.environ.get("DIE_AFTER", "20"))
steps = int(os.environ.get("STEPS", "30"))
attempt = int(os.environ.get("PSLAUNCH_RESTART_COUNT", "0"))
failing = int(os.environ.get("FAIL_RANK", "1"))

kv = kvcore.create("dist_async")
kv.init([0, 1, 2], [np.zeros(4, np.float32) for _ in range(3)])
kv.set_optimizer(kvcore.optim.Test())
ones = np.ones(4, np.float32)
handles = []
if kv.rank == failing:
    for _ in range(die_after if attempt == 0 else steps):
        handles += [kv.push(0, ones), kv.push(2, ones)]
    for handle in handles:
        handle.wait()
    if attempt == 0:
        raise RuntimeError(f"worker {failing} fails after {die_after} steps")
    print(f"worker {failing} rejoined (restart {attempt}) and pushed {steps} steps", flush=True)
    kv.barrier()
else:
    done = 0
    progress = np.zeros(4, np.float32)
    deadline = time.monotonic() + 120
    while progress[0] < die_after + steps:
        if time.monotonic() > deadline:
            sys.exit(f"worker {kv.rank}: worker {failing}'s replacement did not finish within 120 s (key 2 at {progress[0]})")
        handles = [kv.push(0, ones), kv.push(1, ones)]
        done += 1
        kv.pull(2, out=progress)
    for handle in handles:
        handle.wait()
    kv.barrier()
    total = np.zeros(4, np.float32)
    kv.pull(0, out=total)
    with open(os.path.join(out, f"worker{kv.rank}.txt"), "w") as fh:
        fh.write(f"{done} {total[0]:g} {done + die_after + steps} {os.getpid()}\n")
    print(f"worker {kv.rank} stepped {done} times; key 0 holds {total[0]:g}", flush=True)
