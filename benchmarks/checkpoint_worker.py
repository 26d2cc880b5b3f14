"""The worker of ``benchmarks.checkpoint``; run by the benchmark, not by hand.

``checkpoint_worker.py commit NBYTES REPS DIR``: initialises one float32 key of NBYTES (split into
parts across the servers), then REPS times, in a rotating order: ``State.commit()`` of it (the time
until it returns, training's cost; the sync that follows in the background is waited for, untimed,
before the next measure starts), ``State.commit(wait=True)`` (until the checkpoint is complete and
on disk), and ``numpy.save`` of the same bytes into DIR (the checkpoint directory's disk), without
and with an fsync. Prints one ``RESULT {json}`` line of seconds per measure.

``checkpoint_worker.py train OUTDIR``: a short dist_sync training run that commits every 5 steps;
worker 1 raises at step 17 on the job's first start. Worker 1 writes the time of its failure to
OUTDIR/fault.time, worker 0 the time its restarted self resumed (after ``restore``) to
OUTDIR/resumed.time.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import kvcore


def commit(nbytes: int, reps: int, directory: str) -> None:
    kv = kvcore.create("dist_sync")
    value = np.arange(nbytes // 4, dtype=np.float32)
    kv.init(0, value)
    state = kvcore.elastic.State(kv, rep=0)
    baseline = os.path.join(directory, "numpy-save-baseline.npy")
    times: dict[str, list[float]] = {"commit": [], "commit+wait": [], "numpy.save": [], "numpy.save+fsync": []}

    def run_commit() -> None:
        state.commit()

    def run_commit_wait() -> None:
        state.commit(wait=True)

    def run_save() -> None:
        np.save(baseline, value)

    def run_save_sync() -> None:
        with open(baseline, "wb") as fh:
            np.save(fh, value)
            fh.flush()
            os.fsync(fh.fileno())

    runs = [("commit", run_commit), ("numpy.save", run_save), ("commit+wait", run_commit_wait),
            ("numpy.save+fsync", run_save_sync)]
    for rep in range(reps):
        state.rep = rep
        turn = rep % len(runs)
        for name, run in runs[turn:] + runs[:turn]:  # rotated, so that load hits all alike
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
            if name.startswith("commit"):
                state.wait()  # the background sync ends before the next measure starts
            else:
                os.remove(baseline)
    sys.stdout.write("RESULT " + json.dumps({"nbytes": nbytes, "seconds": times}) + "\n")
    sys.stdout.flush()


def train(out: str) -> None:
    attempt = int(os.environ.get("PSLAUNCH_RESTART_COUNT", "0"))
    kv = kvcore.create("dist_sync")
    kv.init([0, 1], [np.zeros(1000, np.float32), np.zeros((200, 50), np.float32)])
    kv.set_optimizer(kvcore.optim.SGD(learning_rate=0.1, momentum=0.9))
    state = kvcore.elastic.State(kv, step=0)
    state.restore()
    if attempt == 1 and kv.rank == 0:
        with open(os.path.join(out, "resumed.time"), "w") as fh:
            fh.write(repr(time.time()))
    grads = {0: np.ones(1000, np.float32), 1: np.ones((200, 50), np.float32)}
    for step in range(state.step, 30):
        if attempt == 0 and kv.rank == 1 and step == 17:
            with open(os.path.join(out, "fault.time"), "w") as fh:
                fh.write(repr(time.time()))
            raise RuntimeError("worker 1 fails at step 17")
        for key, grad in grads.items():
            kv.push(key, grad)
        for key, grad in grads.items():
            kv.pull(key, out=np.empty_like(grad))
        state.step = step + 1
        if state.step % 5 == 0:
            state.commit()


if __name__ == "__main__":
    if sys.argv[1] == "commit":
        commit(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        train(sys.argv[2])
