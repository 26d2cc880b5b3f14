"""Parameter shapes of real models, for placement tests and benchmarks (no framework needed).

``resnet50()``: the 161 parameter tensors of torchvision's ResNet-50 (53 convolutions, 53 batch
norms' weight and bias, the classifier), in model order, 25.6 M values. ``bert_base()``: the 197 of
BERT-base (embeddings, 12 layers, no pooler), 108.9 M values. ``random_keys(100)``: sizes drawn
log-uniform from 10 to 2 M values, a fixed seed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["resnet50", "bert_base", "random_keys", "MODELS"]


def resnet50() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    width = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(planes, width, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:  # the projection shortcut
                shapes += [(planes * 4, width, 1, 1), (planes * 4,), (planes * 4,)]
            width = planes * 4
    return shapes + [(1000, 2048), (1000,)]


def bert_base() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(30522, 768), (512, 768), (2, 768), (768,), (768,)]
    for _ in range(12):
        shapes += [(768, 768), (768,)] * 3  # query, key, value
        shapes += [(768, 768), (768,), (768,), (768,), (3072, 768), (3072,), (768, 3072), (768,), (768,), (768,)]
    return shapes


def random_keys(count: int = 100, seed: int = 0) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [(int(n),) for n in np.exp(rng.uniform(np.log(10), np.log(2_000_000), count)).astype(int)]


MODELS = {"ResNet-50": resnet50, "BERT-base": bert_base, "100 random keys": random_keys}
