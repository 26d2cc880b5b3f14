"""A user-defined updater shipped to the servers (importable there through PYTHONPATH)."""

import numpy as np


class ScaledAdd:
    """``stored += factor * merged``; records the shapes it saw at init_key and refuses key 'bad'."""

    def __init__(self, factor):
        self.factor = factor
        self.init_shapes = {}

    def init_key(self, key, value):
        self.init_shapes[key] = value.shape
        value += 100  # the server's copy starts 100 higher: proves init_key ran there

    def __call__(self, key, merged, stored):
        if key == "bad":
            raise ValueError("this updater refuses key 'bad'")
        expected = (3, 4) if key == "small" else (None,)
        if expected != (None,):
            assert merged.shape == expected and stored.shape == expected, (key, merged.shape)
        else:
            assert merged.ndim == 1 and stored.ndim == 1, (key, merged.shape)  # split keys: flat shards
        stored += np.asarray(self.factor, stored.dtype) * merged
