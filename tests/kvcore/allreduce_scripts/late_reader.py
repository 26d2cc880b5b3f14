"""Worker: worker 0 finishes while worker 1, stopped, has not read worker 0's last messages.

Worker 1 starts ``COUNT`` small allreduces (its values leave at once), then broadcasts a token on
the same connection, behind them. Worker 0 waits for the token, so every value of worker 1 is here
(ZeroMQ keeps a connection's order), stops worker 1 (SIGSTOP), and starts the same collectives: each
completes at once on worker 1's values, so worker 0 finishes while hundreds of its messages still
wait in its queues behind the stopped reader. They must still arrive: every sum exact on both.

Worker 0 checks that worker 1 is still stopped when it finishes and says so (``FINISHING WHILE
WORKER 1 IS STOPPED``; the test asserts the line, so the scenario is never skipped silently), then
has worker 1 continued ``CONTINUE_AFTER`` seconds later: its finish, which starts right after that
line, waits up to ``LEFT_GRACE`` (5 s) for worker 1 to read the rest.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

from kvcore import collectives as C

COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 600
CONTINUE_AFTER = 1


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


rank = C.rank()
pids = C.allgather(np.array([os.getpid()], np.int64))  # both workers run on this host in the test
C.barrier()
values = [np.full(1, rank + 1, np.int64) for _ in range(COUNT)]
if rank == 1:
    handles = [C.allreduce(v, key=("late", i), wait=False) for i, v in enumerate(values)]
    C.broadcast(np.zeros(1, np.int64), root=1, key="sent")
else:
    C.broadcast(np.zeros(1, np.int64), root=1, key="sent")  # after every value worker 1 sent before it
    peer = int(pids[1][0])
    os.kill(peer, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while state(peer) != "T":
        assert time.monotonic() < deadline, f"worker 1 (pid {peer}) did not stop within 30 s"
        time.sleep(0.01)
    handles = [C.allreduce(v, key=("late", i), wait=False) for i, v in enumerate(values)]
for handle in handles:
    handle.wait(60)
assert all(v[0] == 3 for v in values), [v[0] for v in values[:4]]
if rank == 0:
    assert state(peer) == "T", "worker 1 was continued before worker 0 finished"
    print("FINISHING WHILE WORKER 1 IS STOPPED", flush=True)
    subprocess.Popen(["sh", "-c", f"sleep {CONTINUE_AFTER}; kill -CONT {peer}"])
print("OK", rank, flush=True)
