"""Train a two-layer network on the digits data set with the shared model, and time the overlap.

    python examples/overlap_mlp.py --devices 0 1 --epochs 5

Every device id runs in a thread of its own (a GPU each when CuPy sees GPUs, else a CPU slot) and
trains on its share of each global batch. Without ``--devices`` it uses every GPU, or two CPU slots. Weights live with the model's updater (plain SGD,
``update_on_server=1``); devices push gradients and pull weights.

Two schedules, same arithmetic (so the same weights and accuracy):

* ``overlap`` (mshadow-ps's pattern): backprop pushes layer 2's gradient and asks for its weights
  the moment that gradient exists, then does the same for layer 1. The next step waits for layer
  1's weights only before layer 1's forward, and for layer 2's only before layer 2's forward, so
  communication runs behind the compute that does not need it. Layer 1 gets the higher priority:
  it is needed first.
* ``sync``: all gradients are pushed after backprop, and the device waits for every pull at once
  before the next step.

Prints one line per schedule (seconds per epoch, test accuracy) and the speed-up; ``--json PATH``
writes the figures. Needs scikit-learn, whose wheel ships the digits data set.

``--kind dist`` runs the same across worker processes, the SGD on the parameter servers (each
worker trains on its share of every global batch; rank 0 reports):

    pslaunch --launcher local -s 1 -n 2 examples/overlap_mlp.py --kind dist --devices 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

# One BLAS thread per device thread: the devices are the parallelism here.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import kvcore  # noqa: E402
from kvcore import arrays  # noqa: E402

# The examples directory is not a package; the servers load this file too (for the updater's class),
# so the path goes in here rather than relying on the script's directory being first on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_threads import run_device_threads  # noqa: E402

LAYERS = (("w1", "b1"), ("w2", "b2"))


def load_digits_split(seed: int = 0, test_fraction: float = 0.25):
    """``(x_train, y_train, x_test, y_test)`` of scikit-learn's bundled 8x8 digits (1797 images)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise SystemExit("this example needs scikit-learn for its bundled digits data set: pip install scikit-learn") from exc
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * (1 - test_fraction))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


class SGD(kvcore.ModelUpdater):
    """Plain SGD where the weights live; starts from seeded random weights (zeros for biases).

    Keys are named ``RUN.LAYER`` (``3.w1``): every run starts from the same weights.
    """

    def __init__(self, learning_rate: float, batch: int, seed: int, shapes: dict) -> None:
        self.learning_rate = learning_rate
        self.batch = batch
        self.seed = seed
        self.shapes = shapes

    def init_model(self, key, data):
        name = key.rsplit(".", 1)[-1]
        if name.startswith("w"):
            shape = self.shapes[name]
            rng = np.random.default_rng([self.seed, int(name[1:])])
            start = rng.normal(0.0, np.sqrt(2.0 / shape[0]), shape).astype(data.dtype)
            if data.size != start.size:  # a shard of a key split across servers
                raise ValueError(f"{key}: split keys are not supported by this example (raise PSLAUNCH_BIGARRAY_BOUND)")
            arrays.copy_into(data, start.reshape(data.shape))
        else:
            data[...] = 0

    def update(self, key, grad):
        weight = self.weight(key)
        weight -= grad * weight.dtype.type(self.learning_rate / self.batch)


def train_device(model, devid, keys, data, args, schedule, timings, barrier, final):
    """One device's training loop: its share of every global batch, for ``args.epochs`` epochs."""
    x_train, y_train, shapes = data
    device = model.device(devid)
    ndev = len(model.devices)
    # this device's slot among every device of every worker
    slot, slots = model.rank * ndev + model.devices.index(devid), model.num_workers * ndev
    with arrays.device_context(device):
        xp = arrays.array_module(arrays.zeros((1,), np.float32, device))
        params = {k: arrays.zeros(s, np.float32, device) for k, s in shapes.items()}
        grads = {k: arrays.zeros(s, np.float32, device) for k, s in shapes.items()}
        for name in shapes:
            model.init_key(shapes[name], keys[name], devid)
            model.pull_req(params[name], keys[name], devid)  # starting weights
        x_all = arrays.to_device(x_train, device)
        y_all = arrays.to_device(y_train, device)
        steps = len(x_train) // (args.batch * slots)
        barrier.wait()
        start = time.perf_counter()
        for _epoch in range(args.epochs):
            for step in range(steps):
                lo = (step * slots + slot) * args.batch
                x, y = x_all[lo : lo + args.batch], y_all[lo : lo + args.batch]
                # forward, waiting for each layer's weights only when that layer runs
                for name in LAYERS[0]:
                    model.pull_wait(keys[name], devid)
                h = xp.maximum(x @ params["w1"] + params["b1"], 0)
                for name in LAYERS[1]:
                    model.pull_wait(keys[name], devid)
                logits = h @ params["w2"] + params["b2"]
                logits -= logits.max(axis=1, keepdims=True)
                prob = xp.exp(logits)
                prob /= prob.sum(axis=1, keepdims=True)
                prob[xp.arange(len(y)), y] -= 1  # d(cross-entropy)/d(logits), summed over the batch
                # backward: layer 2 first; its input gradient needs the current w2, so it comes
                # before the pull that overwrites w2
                xp.matmul(h.T, prob, out=grads["w2"])
                prob.sum(axis=0, out=grads["b2"])
                dh = prob @ params["w2"].T
                if schedule == "overlap":
                    _send(model, keys, grads, params, LAYERS[1], devid, priority=0)
                dh *= h > 0
                xp.matmul(x.T, dh, out=grads["w1"])
                dh.sum(axis=0, out=grads["b1"])
                if schedule == "overlap":
                    _send(model, keys, grads, params, LAYERS[0], devid, priority=1)
                else:
                    for layer in LAYERS:
                        _send(model, keys, grads, params, layer, devid, priority=0)
                    for name in shapes:
                        model.pull_wait(keys[name], devid)
        for name in shapes:
            model.pull_wait(keys[name], devid)
        arrays.synchronize_stream(device)
        timings[devid] = time.perf_counter() - start
        final[devid] = {k: arrays.asnumpy(v).copy() for k, v in params.items()}


def _send(model, keys, grads, params, layer, devid, priority):
    for name in layer:
        model.push(grads[name], keys[name], devid, priority=priority)
        model.pull_req(params[name], keys[name], devid, priority=priority)


def run(model, tag: str, schedule: str, args, data, shapes) -> dict:
    """Train once with ``schedule`` on fresh keys; return seconds per epoch and the test accuracy."""
    x_train, y_train, x_test, y_test = data
    keys = {name: f"{tag}.{name}" for name in shapes}
    timings: dict[int, float] = {}
    final: dict[int, dict] = {}
    barrier = threading.Barrier(len(args.devices))
    model.barrier()  # 'dist': every worker starts the run together

    def device(devid):
        train_device(model, devid, keys, (x_train, y_train, shapes), args, schedule, timings, barrier, final)

    # A failing device aborts the barrier, so the others stop waiting for it.
    errors = run_device_threads(device, args.devices, on_error=lambda exc: barrier.abort())
    if errors:
        raise errors[0]
    if model.kind == "dist":
        model.barrier()  # every worker's pushes are on the servers
        weights = {name: model.get_weight(keys[name], args.devices[0]) for name in shapes}
    else:
        weights = final[args.devices[0]]  # every device pulled the same final weights
    h = np.maximum(x_test @ weights["w1"] + weights["b1"], 0)
    accuracy = float(np.mean((h @ weights["w2"] + weights["b2"]).argmax(axis=1) == y_test))
    seconds = max(timings.values())
    return {"schedule": schedule, "seconds_per_epoch": seconds / args.epochs, "test_accuracy": accuracy, "weights": weights}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", help="device ids (default: every GPU, or CPU slots 0 1)")
    parser.add_argument("--kind", choices=["local", "dist"], default="local",
                        help="dist: run under pslaunch; the SGD runs on the servers")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="examples per device per step")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--schedule", choices=["overlap", "sync", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=1, help="time each schedule this many times; keep the best")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.devices is None:
        on_gpu = args.device == "gpu" or (args.device == "auto" and arrays.gpu_available())
        args.devices = list(range(arrays.num_gpus())) if on_gpu and arrays.num_gpus() else [0, 1]
    data = load_digits_split(args.seed)
    shapes = {"w1": (data[0].shape[1], args.hidden), "b1": (args.hidden,), "w2": (args.hidden, 10), "b2": (10,)}
    updater = SGD(args.lr, args.batch * len(args.devices), args.seed, shapes)
    schedules = ["sync", "overlap"] if args.schedule == "both" else [args.schedule]
    runs: dict[str, list[dict]] = {s: [] for s in schedules}
    with kvcore.create_shared_model(args.kind, updater=updater, update_on_server=1, device=args.device) as model:
        model.init(args.devices)
        for i in range(args.repeat):
            # alternate the order so that a warming or a busy machine does not favour one schedule
            for schedule in schedules if i % 2 == 0 else schedules[::-1]:
                runs[schedule].append(run(model, f"{i}{schedule}", schedule, args, data, shapes))
        rank, workers = model.rank, model.num_workers
        backend = str(model.device(args.devices[0]))
        model.barrier()
    if rank != 0:
        return 0  # rank 0 reports for the job
    results = {}
    for schedule in schedules:
        results[schedule] = min(runs[schedule], key=lambda r: r["seconds_per_epoch"])
        r = results[schedule]
        median = float(np.median([x["seconds_per_epoch"] for x in runs[schedule]]))
        r["median_seconds_per_epoch"] = median
        print(
            f"{schedule:8s} best {r['seconds_per_epoch'] * 1000:8.1f} ms/epoch  median {median * 1000:8.1f} ms/epoch"
            f"   test accuracy {r['test_accuracy']:.4f}",
            flush=True,
        )
    report = {
        "kind": args.kind,
        "workers": workers,
        "devices": args.devices,
        "backend": backend.split("(")[0],  # where the model ran: "gpu" or "cpu"
        "epochs": args.epochs,
        "batch_per_device": args.batch,
        "hidden": args.hidden,
        "repeat": args.repeat,
        "results": {
            k: {
                "best_seconds_per_epoch": v["seconds_per_epoch"],
                "median_seconds_per_epoch": v["median_seconds_per_epoch"],
                "test_accuracy": v["test_accuracy"],
            }
            for k, v in results.items()
        },
    }
    if len(results) == 2:
        same = all(np.array_equal(results["sync"]["weights"][k], results["overlap"]["weights"][k]) for k in results["sync"]["weights"])
        speedup = results["sync"]["seconds_per_epoch"] / results["overlap"]["seconds_per_epoch"]
        report.update(speedup=speedup, identical_weights=same)
        print(f"overlap speed-up (best times) {speedup:.2f}x; identical weights in both schedules: {same}")
        # several asynchronous workers interleave differently each run: only one process is exact
        if not same and workers == 1:
            print("error: the two schedules trained different weights", file=sys.stderr)
            return 1
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
