"""Worker (argv: cpu|gpu): the 'dist' shared model with its devices' arrays there (every GPU, or two
CPU slots): starting weights pulled into strided targets, three rounds from every device, exact;
on GPUs a fourth round while each device's default stream is busy for seconds."""

import os
import sys

import numpy as np

import kvcore
from kvcore import arrays


class AddUpdater(kvcore.ModelUpdater):
    """Starts every key at 1 and adds each merged gradient (the servers load this script for it)."""

    def init_model(self, key, data):
        data[...] = 1

    def update(self, key, grad):
        self.weight(key)[...] += grad


if __name__ == "__main__":
    # the test kit lives in tests/kvcore (here, not at the top: the servers load this file for the updater)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kvcore_testkit import default_stream_busy, finish_default_stream, keep_default_stream_busy, run_device_threads

    kind = sys.argv[1]
    model = kvcore.create_shared_model("dist", updater=AddUpdater(), device=kind, timeout=60)
    devids = list(range(arrays.num_gpus())) if kind == "gpu" else [0, 1]
    model.init(devids)
    assert all(model.device(d).is_gpu == (kind == "gpu") for d in devids), arrays.gpu_status()
    shapes = {"w": (64, 33), "b": (7,)}

    def device(devid):
        dev = model.device(devid)
        with arrays.device_context(dev):
            targets = {}
            for key, shape in shapes.items():
                model.init_key(shape, key, devid)
                wide = arrays.zeros(shape[:-1] + (2 * shape[-1],), np.float32, dev)
                targets[key] = wide[..., ::2]  # strided: the host-to-GPU copy must handle it
                model.pull_req(targets[key], key, devid)
            for key in shapes:
                model.pull_wait(key, devid)
                assert np.all(arrays.asnumpy(targets[key]) == 1), (key, devid)
            for r in range(3):
                for key, shape in shapes.items():
                    grad = arrays.zeros(shape, np.float32, dev) + (devid + 1)
                    model.push(grad, key, devid)
                    model.pull_req(targets[key], key, devid)
                for key in shapes:
                    model.pull_wait(key, devid)
                    expected = 1 + (r + 1) * sum(d + 1 for d in devids)
                    got = arrays.asnumpy(targets[key])
                    assert np.all(got == expected), (key, devid, r, float(got.max()), expected)
            if dev.is_gpu:
                # a round while the default stream is busy for seconds: the download to the
                # servers, the upload of their answer and the pull's copy run on streams of their own
                grad = arrays.zeros(shapes["w"], np.float32, dev) + (devid + 1)
                model.push(grad, "w", devid)
                model.pull_req(targets["w"], "w", devid)
                keep_default_stream_busy(dev, 4.0)
                model.pull_wait("w", devid)
                busy = default_stream_busy(dev)
                finish_default_stream(dev)
                assert busy, f"device {devid}: pull_wait returned only after the default stream finished"
                got = arrays.asnumpy(targets["w"])
                assert np.all(got == 1 + 4 * sum(d + 1 for d in devids)), (devid, float(got.max()))

    run_device_threads(device, devids, join_timeout=120)
    model.barrier()
    model.close()
    print("OK", model.rank, flush=True)
