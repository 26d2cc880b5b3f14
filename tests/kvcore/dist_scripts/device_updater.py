"""An optimizer's Updater shipped to the servers that first checks where the server keeps the arrays
(importable there through PYTHONPATH)."""

from kvcore import arrays
from kvcore.optim import Updater


class DeviceCheckingUpdater(Updater):
    """Runs the optimizer only on arrays where the test expects the server's shards: a silent
    fallback to the CPU (or the wrong GPU path) becomes an error the workers' pulls report."""

    def __init__(self, optimizer, expect_gpu):
        super().__init__(optimizer)
        self.expect_gpu = expect_gpu

    def __call__(self, key, grad, weight):
        where = (arrays.device_of(weight), arrays.device_of(grad))
        if any(d.is_gpu != self.expect_gpu for d in where):
            expected = "a GPU" if self.expect_gpu else "the CPU"
            raise RuntimeError(f"key {key!r}: the server's weight and merged push live on {where}, expected {expected}")
        super().__call__(key, grad, weight)
