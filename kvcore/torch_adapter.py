"""PyTorch parameters as kvcore ``Parameter``s: numpy views of CPU tensors, without copies; and
gradient hooks that tell the Trainer when backprop produced a gradient (``watch_gradients``).

``torch`` is imported only when this module's functions run (the ``torch`` extra), so kvcore stays
light without it. A CPU tensor's ``.detach().numpy()`` shares the tensor's memory, so the Trainer's
in-place writes (new weights, summed gradients) land in the model itself, as ``optimizer.step()``
would. The gradient is looked up at every step, because PyTorch replaces ``.grad`` tensors when
``zero_grad(set_to_none=True)`` (its default) has run. GPU tensors are refused: viewing them would
need a copy, and the caller should say where that copy goes.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


__all__ = ["tensor_as_array", "torch_views", "watch_gradients"]


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "the PyTorch adapter needs torch; install the extra: pip install 'pslaunch[torch]'"
        ) from exc
    return torch


def tensor_as_array(tensor: Any, what: str = "the tensor") -> np.ndarray:
    """A numpy array that shares ``tensor``'s memory (a CPU tensor; ``what`` names it in errors).

    Raises:
        ValueError: the tensor is not on the CPU (naming its device).
    """
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{what} lives on {tensor.device}; the PyTorch adapter views CPU tensors as numpy arrays "
            "without copies, so move the model to the CPU (model.cpu())"
        )
    return tensor.detach().numpy()


def torch_views(params: Any) -> list[tuple[str, Any, Callable[[], Any], Any]]:
    """PyTorch parameters (only those with ``requires_grad``) as ``(name, data, grad, tensor)``,
    which ``kvcore.parameters`` makes ``Parameter``s of (this module knows torch, not them).

    ``params`` is a ``torch.nn.Module`` (named by ``named_parameters()``), an iterable of
    ``(name, tensor)`` pairs, a mapping ``name -> tensor``, or an iterable of tensors (named by
    position). ``data`` is a numpy view of the tensor, and ``grad()`` a numpy view of
    ``tensor.grad`` read at every step (None until a backward pass has produced one).
    """
    _torch()
    if hasattr(params, "named_parameters"):
        named = list(params.named_parameters())
    elif isinstance(params, dict):
        named = list(params.items())
    else:
        items = list(params)
        if items and isinstance(items[0], tuple):
            named = [(str(name), tensor) for name, tensor in items]
        else:
            named = [(str(i), tensor) for i, tensor in enumerate(items)]
    return [(name, tensor_as_array(tensor, f"parameter {name!r}"), _grad_getter(name, tensor), tensor)
            for name, tensor in named if getattr(tensor, "requires_grad", True)]


def watch_gradients(tensors: list[Any], ready: Any) -> list[Any]:
    """Call ``ready(i)`` each time backprop has accumulated ``tensors[i]``'s gradient (PyTorch's
    post-accumulate-grad hook, on the thread that runs backward); None entries are skipped.

    Returns the hooks' handles (``handle.remove()`` stops one).
    """
    handles = []
    for i, tensor in enumerate(tensors):
        if tensor is not None:
            handles.append(tensor.register_post_accumulate_grad_hook(lambda _t, i=i: ready(i)))
    return handles


def _grad_getter(name: str, tensor: Any):
    def grad() -> np.ndarray | None:
        if tensor.grad is None:
            return None
        return tensor_as_array(tensor.grad, f"the gradient of {name!r}")

    return grad
