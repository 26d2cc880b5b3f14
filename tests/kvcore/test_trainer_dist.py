"""The Trainer on real jobs (dist_sync with servers, allreduce without; processes on 127.0.0.1): exact steps.

Skips until the runtime (psnode and its test kit) is present.
"""

import json
import re
from pathlib import Path

import pytest

testing = pytest.importorskip("testkit", reason="needs the distributed runtime (testkit)")

SCRIPT = Path(__file__).parent / "training_scripts" / "trainer_rounds.py"
OVERLAP = Path(__file__).parent / "training_scripts" / "torch_overlap.py"


def _expected_weights(num_workers, steps=3, lr=0.5, momentum=0.5, batch=4, threshold=None):
    """SGD with momentum from rank 0's start (1.0) on the gradient summed over 2 replicas and the
    workers; with a 2bit ``threshold``, each worker's sum is quantized with its residual first. (Every
    gradient, sum and weight here is exact at half width, and topk with ratio 1 sends every value.)"""
    w, mom, trajectory = 1.0, 0.0, []
    residuals = [0.0] * num_workers
    for s in range(steps):
        local = [(r + 1) * (1 + 2) * (s + 1) for r in range(num_workers)]
        if threshold is not None:  # every value is exact in float32 here (small multiples of powers of 2)
            for r in range(num_workers):
                residuals[r] += local[r]
                sent = threshold if residuals[r] >= threshold else -threshold if residuals[r] <= -threshold else 0
                residuals[r] -= sent
                local[r] = sent
        summed = sum(local)
        mom = momentum * mom - lr * summed / batch
        w += mom
        trajectory.append(w)
    return trajectory


@pytest.mark.parametrize("store, servers, mode, threshold", [
    ("dist_sync", 2, "store", None), ("dist_sync", 2, "worker", None), ("dist_sync", 2, "store", 2.0),
    ("allreduce", 0, "store", None), ("allreduce", 0, "worker", None),
    ("dist_sync", 2, "store", {"type": "fp16"}), ("dist_sync", 2, "worker", {"type": "bf16"}),
    ("allreduce", 0, "worker", {"type": "fp16"}), ("allreduce", 0, "store", {"type": "topk", "ratio": 1}),
])
@pytest.mark.timeout(120)
def test_trainer_takes_rank_0_weights_and_steps_exactly_on_every_worker(store, servers, mode, threshold):
    workers = 2
    given = json.dumps(threshold) if isinstance(threshold, dict) else threshold
    args = [str(SCRIPT), mode, store] + ([str(given)] if threshold is not None else [])
    threshold = None if isinstance(threshold, dict) else threshold
    with testing.LocalJob(workers, servers, worker=args, env={"PSLAUNCH_BIGARRAY_BOUND": "100000"}) as job:
        results = job.wait(90)
    outputs = {r.index: r.output for r in results if r.role == "worker"}
    assert all(r.returncode == 0 for r in results), "\n".join(str(r) for r in results)
    expected = _expected_weights(workers, threshold=threshold)
    for index, out in outputs.items():
        rank = int(re.search(r"^OK (\d+)", out, re.M).group(1))
        synced = json.loads(re.search(rf"^SYNCED {rank} (.*)$", out, re.M).group(1))
        assert synced == {"w": [1.0], "big": [1.0]}, out  # rank 0's start, in every replica
        steps = {int(s): json.loads(v) for s, v in re.findall(rf"^STEP {rank} (\d+) (.*)$", out, re.M)}
        assert [steps[s] for s in range(3)] == [{"w": [w], "big": [w]} for w in expected], out


@pytest.mark.parametrize("store,servers", [("dist_sync", 2), ("allreduce", 0)])
@pytest.mark.timeout(120)
def test_gradients_sent_from_pytorch_hooks_give_the_steps_of_one_process_on_the_global_batch(store, servers):
    pytest.importorskip("torch", reason="the torch extra is not installed")
    with testing.LocalJob(2, servers, worker=[str(OVERLAP), store]) as job:
        results = job.wait(100)
    assert all(r.returncode == 0 for r in results), "\n".join(str(r) for r in results)
    oks = sorted(int(m) for r in results for m in re.findall(r"^OK (\d+)", r.output, re.M))
    assert oks == [0, 1], "\n".join(str(r) for r in results)
