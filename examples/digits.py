"""scikit-learn's bundled digits (8x8 images, 1797 samples, 10 classes) with a fixed held-out split.

The data ships inside the scikit-learn wheel: nothing is downloaded. Install it with the examples
extra: ``pip install 'pslaunch[examples]'``.
"""

from __future__ import annotations

import numpy as np


def load_digits_split(seed: int = 0, test_fraction: float = 0.25):
    """Return ``(x_train, y_train, x_test, y_test)``: float32 pixels in [0, 1] and int64 labels.

    The split is stratified and fixed by ``seed``, so every worker of a job (given the same seed)
    holds out the same test set.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise SystemExit(
            "this example needs scikit-learn for its bundled digits dataset: pip install 'pslaunch[examples]'"
        ) from exc
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test
