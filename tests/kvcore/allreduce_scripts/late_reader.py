"""Worker: worker 0 finishes while worker 1, stopped, has not read worker 0's last messages.

Worker 1 starts ``COUNT`` small allreduces (its values leave at once), then stops itself for 3 s (a
helper process continues it). Worker 0 starts the same collectives once worker 1 is stopped: each
completes at once on worker 1's values, so worker 0 finishes while hundreds of its messages still
wait in its queues behind the stopped reader. They must still arrive: every sum exact on both.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

from kvcore import collectives as C

COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 600
rank = C.rank()
C.barrier()
if rank == 0:
    time.sleep(2)  # worker 1 has sent its values and stopped by then
values = [np.full(1, rank + 1, np.int64) for _ in range(COUNT)]
handles = [C.allreduce(v, key=("late", i), wait=False) for i, v in enumerate(values)]
if rank == 1:
    time.sleep(1)
    subprocess.Popen(["sh", "-c", f"sleep 3; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
for handle in handles:
    handle.wait(60)
assert all(v[0] == 3 for v in values), [v[0] for v in values[:4]]
print("OK", rank, flush=True)
