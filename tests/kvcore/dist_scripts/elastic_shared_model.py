"""Worker: a 'dist' shared model resumes from a checkpoint (kvcore.elastic.State(model, ...)).

Usage: elastic_shared_model.py OUTDIR PHASE. The updater starts every key at 1 and adds each push.
``save``: 3 rounds of pushing ones, commit, 2 more. ``restore``: restore before ``init_key``, so the
key starts from the checkpoint (1 + 3 x workers, not init_model's 1), then rounds 3 and 4. Both
print ``START <value>`` and ``FINAL <value>``.
"""

import sys

import numpy as np

import kvcore


class Accumulate(kvcore.ModelUpdater):
    def init_model(self, key, data):
        data[...] = 1

    def update(self, key, grad):
        self.weight(key)[...] += grad


if __name__ == "__main__":
    out, phase = sys.argv[1], sys.argv[2]
    model = kvcore.create_shared_model("dist", updater=Accumulate(), device="cpu", timeout=30)
    with model:
        model.init([0])
        state = kvcore.elastic.State(model, rounds=0)
        assert state.restore() is (phase == "restore")
        model.init_key((6,), 0, 0)
        print("START", float(model.get_weight(0, 0)[0]), flush=True)
        model.barrier()  # every worker read its start before any pushes (dist_async applies them at once)
        data = np.ones(6, np.float32)
        for r in range(state.rounds, 5):
            model.push(np.ones(6, np.float32), 0, 0)
            model.pull_req(data, 0, 0)
            model.pull_wait(0, 0)
            state.rounds = r + 1
            if state.rounds == 3 and phase == "save":
                state.commit()
        model.barrier()
        print("FINAL", float(model.get_weight(0, 0)[0]), flush=True)
        rank = model.rank
    print("OK", rank, flush=True)
