"""A small multilayer perceptron written once for numpy and CuPy: forward, backward, softmax cross-entropy.

Every function takes the array module from its inputs (``kvcore.arrays.array_module``), so the same
code runs on the CPU with numpy arrays and on a GPU with CuPy arrays. Parameters are a dict
``name -> array``: ``w0, b0, w1, b1, ...``, one weight matrix and bias per layer, ReLU between layers.
"""

from __future__ import annotations

import numpy as np

from kvcore.arrays import array_module


def init_params(sizes: list[int], seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """He-initialised weights and zero biases for layer sizes like ``[64, 64, 10]`` (numpy, host)."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(dtype)
        params[f"b{i}"] = np.zeros(fan_out, dtype)
    return params


def _num_layers(params: dict) -> int:
    return len(params) // 2


def forward(params: dict, x):
    """Return the logits for inputs ``x`` and the activations backward needs."""
    xp = array_module(x)
    activations = [x]
    h = x
    n = _num_layers(params)
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = xp.maximum(h, 0)
        activations.append(h)
    return h, activations


def softmax_cross_entropy(logits, labels):
    """Summed cross-entropy of ``logits`` against integer ``labels`` and its gradient w.r.t. the logits."""
    xp = array_module(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    probs = exp / exp.sum(axis=1, keepdims=True)
    rows = xp.arange(labels.shape[0])
    loss = -xp.log(probs[rows, labels] + 1e-12).sum()
    dlogits = probs
    dlogits[rows, labels] -= 1
    return float(loss), dlogits


def loss_and_grads(params: dict, x, labels):
    """The batch's summed loss and the gradients of that sum, as a dict shaped like ``params``.

    The gradients are sums over the batch (not means): the Trainer divides by the batch size.
    """
    logits, activations = forward(params, x)
    loss, delta = softmax_cross_entropy(logits, labels)
    grads = {}
    for i in reversed(range(_num_layers(params))):
        grads[f"w{i}"] = activations[i].T @ delta
        grads[f"b{i}"] = delta.sum(axis=0)
        if i > 0:
            delta = (delta @ params[f"w{i}"].T) * (activations[i] > 0)
    return loss, grads


def accuracy(params: dict, x, labels) -> float:
    """Fraction of ``x`` whose predicted class equals ``labels``."""
    logits, _ = forward(params, x)
    return float((logits.argmax(axis=1) == labels).mean())
