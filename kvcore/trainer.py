"""The Trainer: one optimizer step of data-parallel training through a KVStore.

A ``Trainer`` holds a model's parameters (one array per device for each: its *replicas*) and a
KVStore, and does what MXNet's gluon ``Trainer`` does each step:

* ``update_on_kvstore=True`` (the default for ``dist_*`` stores): the gradients of every device
  (and, in a distributed store, every worker) are pushed, the store sums them and runs the optimizer
  once, and the new weights are pulled into every replica.
* ``update_on_kvstore=False`` (the default for ``local``, ``device`` and ``allreduce``): the
  gradients are pushed, their sum is pulled back into the gradient arrays (an all-reduce), and the
  optimizer runs here; with a store whose workers sum among themselves the gradients are summed in
  place through its collectives instead (``KVStoreBase.collectives``).

With PyTorch parameters each group of gradients leaves as soon as backprop produced it
(``trainer_handoff``). Parameters and the forms they are given in are ``kvcore.parameters``'.

Gradients are sums over samples; the optimizer's ``rescale_grad`` is set to ``scale / batch_size``
so that a step applies their mean. The Trainer is written against ``KVStoreBase``'s public API only,
so it works the same with every store.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from . import arrays
from .errors import DTypeMismatchError, ShapeMismatchError
from .optim.base import Optimizer, Updater, create as create_optimizer
from .parameters import Parameter, as_list, from_framework, normalise_params
from .stores.base import KVStoreBase
from .stores.registry import create as create_store
from .trainer_handoff import HandOff

__all__ = ["Parameter", "Trainer"]  # Parameter lives in kvcore.parameters

class Trainer:
    """Applies an optimizer to a set of parameters, synchronising their gradients through a KVStore.

    Args:
        params: the parameters: a mapping ``name -> array | list of replicas | Parameter``, a
            sequence of those (arrays named by position: ``'0'``, ``'1'``, ...), a ``torch.nn.Module``, or
            PyTorch tensors / ``named_parameters()`` (through ``kvcore.torch_adapter``; CPU only).
            Their arrays are updated in place.
        optimizer: an ``Optimizer``, or a name for ``kvcore.optim.create`` with ``optimizer_params``.
        kvstore: a store name for ``kvcore.create`` or a store.
        compression_params: gradient compression for the store, as gluon's Trainer takes it: a
            dict for ``kvstore.set_gradient_compression`` such as ``{'type': '2bit', 'threshold':
            0.5}`` or ``{'type': 'topk', 'ratio': 0.01}``. Needs a ``device``, ``dist_*`` or
            ``allreduce`` store and float32 parameters; checked here, so a bad one fails before any
            step.
        update_on_kvstore: run the optimizer in the store (True) or here (False); None chooses True
            for distributed (``dist_*``) stores and False otherwise.
        scale: extra factor on the gradients (``rescale_grad = scale / batch_size``).
        timeout: seconds to wait for each pull before ``KVTimeoutError``; None waits as long as the
            store does (a distributed store fails on its own when a peer dies).
        coalesce_bytes: parameters smaller than this travel together, up to this many bytes per
            call (see below).
        overlap: with PyTorch parameters, send each group's gradients as soon as backprop has
            produced all of them (from the second step on), as DDP's buckets do, so that sending
            overlaps the rest of the backward pass; ``step`` then sends what is left and waits.
            One backward pass per step: for gradient accumulation over several, pass False.
        compression: the same as ``compression_params`` (give one of the two), or a type's name
            alone: ``compression='fp16'`` is ``{'type': 'fp16'}``. With compression on, a store that
            sums among the workers (``allreduce``) sums the encoded gradients through the store
            instead of in place.

    Keys in the store are the parameter names. Parameter ``i`` is pushed and pulled with priority
    ``-i``, as in MXNet: the first layers' weights, needed first by the next forward pass, go first.
    Consecutive parameters smaller than ``coalesce_bytes`` travel together in one push and one pull
    (with the priority of the first of them): a model of many small tensors then costs a few
    messages per step instead of one per tensor. ``coalesce_bytes=0`` sends every parameter alone.
    The store's keys are initialised by ``sync_params`` or the first ``step`` (in a distributed
    store rank 0's values win and every worker pulls them).

    With a store whose workers sum among themselves (``allreduce``) and the optimizer run here
    (``update_on_kvstore=False``, its default there), gradients are summed in place through the
    store's collectives (``kvcore.collectives``): no copy into the store and back, and
    ``sync_params`` broadcasts worker 0's weights.

    Not thread-safe.
    """

    def __init__(
        self,
        params: Any,
        optimizer: Optimizer | str,
        optimizer_params: Mapping[str, Any] | None = None,
        kvstore: KVStoreBase | str = "local",
        compression_params: dict[str, Any] | None = None,
        update_on_kvstore: bool | None = None,
        scale: float = 1.0,
        timeout: float | None = None,
        coalesce_bytes: int = 1 << 20,
        overlap: bool = True,
        compression: dict[str, Any] | str | None = None,
    ) -> None:
        self._params = normalise_params(params)
        self._groups = _plan_groups(self._params, int(coalesce_bytes))
        self._index = {p.name: i for i, p in enumerate(self._params)}
        if isinstance(optimizer, str):
            optimizer = create_optimizer(optimizer, **dict(optimizer_params or {}))
        elif optimizer_params:
            raise ValueError("optimizer_params is only used with an optimizer name, not an Optimizer instance")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an Optimizer or a name, got {type(optimizer).__name__}")
        self._optimizer = optimizer
        if isinstance(kvstore, str):
            kvstore = create_store(kvstore)
        if not isinstance(kvstore, KVStoreBase):
            raise TypeError(f"kvstore must be a KVStoreBase or a store name, got {type(kvstore).__name__}")
        self._kv = kvstore
        # gradients go without a copy (see ``_send_group``) to a store whose push takes ``copy``; a
        # store a user derived with push's older signature is called as before
        self._push_options = {"copy": False} if "copy" in inspect.signature(kvstore.push).parameters else {}
        if compression is not None:
            if compression_params is not None:
                raise ValueError("give the gradient compression once: compression= or compression_params=, not both")
            compression_params = {"type": compression} if isinstance(compression, str) else compression
        if compression_params is not None:
            self._set_compression(compression_params)
        if update_on_kvstore is None:
            update_on_kvstore = kvstore.type.startswith("dist")
        self._update_on_kvstore = bool(update_on_kvstore)
        if kvstore.elastic and not self._update_on_kvstore:
            raise ValueError("Trainer(update_on_kvstore=False) sums the gradients among the workers with collectives, "
                             "whose groups do not follow an elastic job's members (-n MIN:MAX); keep the optimizer in "
                             "the store (update_on_kvstore=True, the default for a distributed store)")
        self._updater = None if self._update_on_kvstore else Updater(optimizer)
        self._scale = float(scale)
        self._timeout = timeout
        self._params_synced = False
        self._store_rescale: float | None = None  # rescale_grad the store's optimizer was shipped with
        # gradients summed in place through the collectives, unless the store encodes them on the way
        self._coll = None if self._update_on_kvstore or compression_params is not None else kvstore.collectives
        self._coalesce = int(coalesce_bytes)
        self._hand_off = HandOff(self._params, self._groups, self._send_complete_group) if overlap else None

    # ---- properties -------------------------------------------------------------------------
    @property
    def params(self) -> list[Parameter]:
        """The parameters, in priority order (the first has the highest priority, 0)."""
        return list(self._params)

    @property
    def kvstore(self) -> KVStoreBase:
        """The store the gradients go through."""
        return self._kv

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer (a copy of it runs in the store when ``update_on_kvstore``)."""
        return self._optimizer

    @property
    def update_on_kvstore(self) -> bool:
        """True when the optimizer runs in the store."""
        return self._update_on_kvstore

    @property
    def learning_rate(self) -> float:
        """The optimizer's learning rate."""
        return self._optimizer.learning_rate

    # ---- steps ------------------------------------------------------------------------------
    def sync_params(self) -> None:
        """Initialise the store's keys from the parameters and pull them back into every replica.

        In a distributed store rank 0's values win, so afterwards every worker holds the same
        weights. Runs once; ``step`` calls it when it has not run. Blocks until the weights arrive.
        """
        if self._params_synced:
            return
        if self._coll is not None:
            self._coll.broadcast_parameters(self._params, root=0)
            self._params_synced = True
            return
        names = [p.name for p in self._params]
        self._kv.init(names, [p.list_data()[0] for p in self._params])
        self._wait_all(self._pull_groups([p.list_data() for p in self._params]))
        self._params_synced = True

    def step(self, batch_size: int, grads: Any = None) -> None:
        """One optimizer step from the gradients of a batch of ``batch_size`` samples.

        Args:
            batch_size: the number of samples the aggregated gradient sums over. Gradients from every
                device and worker are summed, so with a distributed store pass the global batch
                (per-worker batch x ``num_workers``) to step with their mean, as one worker would.
                In an elastic job (``-n MIN:MAX``) read ``kv.num_workers`` during the step (after
                the last step's pulls it counts this step's members): each step's mean is over its
                own members; with ``update_on_kvstore`` the per-worker batch must stay the same.
            grads: the gradients: a mapping ``name -> array | list (one per replica)``, a sequence in
                parameter order, or None to read each Parameter's own gradients.

        Blocks until every replica holds its new weights. With ``update_on_kvstore=False`` the
        gradient arrays hold the summed gradients afterwards (and the optimizer may have rescaled
        the first replica's in place).

        Raises:
            ValueError: bad ``batch_size``; gradients missing, extra or of the wrong count (naming
                the parameter); ``batch_size`` changed while the optimizer runs in the store.
            ShapeMismatchError, DTypeMismatchError: a gradient unlike its parameter (naming it);
                checked before anything is pushed, so the weights stay as they were.
            KVStoreError: from the store.
        """
        sent = self._hand_off.take(grads is not None) if self._hand_off is not None else {}
        grad_lists = self._gather_grads(grads)
        self._prepare(batch_size)
        handles = self._send_groups(grad_lists, sent)
        if self._hand_off is not None:
            self._hand_off.arm()
        if self._update_on_kvstore:
            self._wait_all(handles)  # the new weights are in every replica
            return
        for (indices, _), handle in zip(self._groups, handles):
            handle.wait(self._timeout)  # update these layers while later layers' sums still arrive
            for i in indices:
                self._update_one(self._params[i], grad_lists[i])

    def allreduce_grads(self, grads: Any = None) -> list[list[Any]]:
        """Sum the gradients over every device and worker, in place (only with ``update_on_kvstore=False``).

        Returns the gradient lists (one per parameter, one array per replica), each array now holding
        the sum. Follow with ``update(batch_size, grads)`` after, e.g., clipping them.
        """
        self._require_local_update("allreduce_grads")
        if not self._params_synced:
            self.sync_params()
        sent = self._hand_off.take(grads is not None) if self._hand_off is not None else {}
        grad_lists = self._gather_grads(grads)
        self._wait_all(self._send_groups(grad_lists, sent))
        return grad_lists

    def update(self, batch_size: int, grads: Any = None) -> None:
        """Apply the optimizer to already summed gradients (see ``allreduce_grads``)."""
        self._require_local_update("update")
        grad_lists = self._gather_grads(grads)
        self._prepare(batch_size)
        for p, g in zip(self._params, grad_lists):
            self._update_one(p, g)

    # ---- internals --------------------------------------------------------------------------
    def _prepare(self, batch_size: int) -> None:
        """Check ``batch_size``, set ``rescale_grad``, initialise keys and the store's optimizer once."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        rescale = self._scale / int(batch_size)
        if not self._params_synced:
            self.sync_params()
        if not self._update_on_kvstore:
            self._optimizer.rescale_grad = rescale
            return
        if self._kv.elastic:  # the store's optimizer takes each member's batch; a push is divided by the members
            rescale *= self._kv.num_workers
        if self._store_rescale is None:
            self._optimizer.rescale_grad = rescale
            self._kv.set_optimizer(self._optimizer)
            self._store_rescale = rescale
        elif self._kv.elastic and math.isclose(rescale, self._store_rescale, rel_tol=1e-9):
            pass  # the members may have changed, each one's batch did not (``_members_scale``)
        elif rescale != self._store_rescale:
            # A distributed store holds its own copy of the optimizer: it cannot see a new rescale.
            first = self._scale / self._store_rescale
            if self._kv.elastic:
                raise ValueError(
                    f"step got batch_size {batch_size} with {self._kv.num_workers} workers, but the optimizer in "
                    f"the store was set up for a batch of {first:g} per worker; in an elastic job with "
                    "update_on_kvstore=True keep each worker's batch constant and pass it x kv.num_workers")
            raise ValueError(
                f"step got batch_size {batch_size}, but the optimizer in the store was set up for "
                f"batch_size {first:g}; with update_on_kvstore=True keep the batch size constant "
                "(drop the last partial batch) or use update_on_kvstore=False"
            )

    def _send_groups(self, grad_lists: list[list[Any]], sent: dict[int, Any]) -> list[Any]:
        """Send every group's gradients that the hand-off has not sent yet; one handle per group,
        done once its result is in place (see ``_send_group``)."""
        return [sent[g] if g in sent else self._send_group(g, grad_lists) for g in range(len(self._groups))]

    def _group_grads(self, g: int) -> list[list[Any]] | None:
        """Group ``g``'s gradients as arrays (a list per parameter; others empty), or None when one
        has none."""
        grads: list[list[Any]] = [[]] * len(self._params)
        for i in self._groups[g][0]:
            p = self._params[i]
            grads[i] = [from_framework(a, p.name) for a in p.list_grad() or []]
            if not grads[i]:
                return None
        return grads

    def _send_complete_group(self, g: int) -> Any:
        """Send group ``g`` from the hand-off, once backprop produced its gradients; its handle, or
        None when one has none after all."""
        grads = self._group_grads(g)
        return None if grads is None else self._send_group(g, grads)

    def _send_group(self, g: int, grad_lists: list[list[Any]]) -> Any:
        """Send group ``g``'s gradients; the handle of its result: the gradients summed in place
        over every device and worker through the collectives, or pushed to the store and pulled
        back (the new weights when the store runs the optimizer, else the summed gradients).

        The pull leaves right after the push, so the result comes back while backprop goes on
        (from the hand-off): a parameter's value is not read again in a backward pass once its
        gradient is complete, and ``step`` waits for every result before it returns.
        """
        indices, priority = self._groups[g]
        if self._coll is None:
            names = [self._params[i].name for i in indices]
            scale = self._members_scale()
            grads = [grad_lists[i] if scale == 1 else [a * scale for a in grad_lists[i]] for i in indices]
            # not copied: a gradient is not written again before its pull's result is in (this step
            # waits for it; with update_on_kvstore=False that pull itself writes it), which comes
            # only after the servers have every byte of this push
            self._kv.push(names, grads, priority=priority, **self._push_options)
            outs = [self._params[i].list_data() if self._update_on_kvstore else grad_lists[i] for i in indices]
            return self._kv.pull(names, out=outs, priority=priority, wait=False)
        firsts = []
        for i in indices:  # this worker's replicas are summed into the first one
            first = grad_lists[i][0]
            for other in grad_lists[i][1:]:
                with arrays.device_context(arrays.device_of(first)):
                    first += other if arrays.device_of(other) == arrays.device_of(first) else \
                        arrays.to_device(other, arrays.device_of(first))
            firsts.append(first)
        futures = self._coll.allreduce_arrays(firsts, firsts, ("trainer", g), max(1, self._coalesce))
        copies = [(grad_lists[i][0], grad_lists[i][1:]) for i in indices if len(grad_lists[i]) > 1]

        def to_replicas() -> None:
            for first, others in copies:
                for other in others:
                    arrays.copy_into(other, first)

        return self._coll.handle_of(futures, "allreduce", then=to_replicas if copies else None)

    def _members_scale(self) -> float:
        """An elastic job with the optimizer in the store, which rescales by one member's batch: ``1 /
        members`` of this step, so each round's sum is the mean over its own members (a joiner
        needs no history: the store's rescale is every member's). 1 otherwise."""
        if not self._update_on_kvstore or not self._kv.elastic:
            return 1.0
        return 1.0 / self._kv.num_workers  # this step's members (the step boundary, once its pulls are in)

    def _pull_groups(self, out_lists: list[list[Any]]) -> list[Any]:
        """Start pulling each parameter's stored value into its outs; return one handle per group."""
        return [
            self._kv.pull([self._params[i].name for i in indices], out=[out_lists[i] for i in indices],
                          priority=priority, wait=False)
            for indices, priority in self._groups
        ]

    def _update_one(self, param: Parameter, grads: list[Any]) -> None:
        """Update replica 0 with the summed gradient and copy it to the others.

        One optimizer state per parameter (not per replica) keeps step counts right for
        optimizers such as Adam, whose bias correction counts updates per key.
        """
        replicas = param.list_data()
        first = replicas[0]
        grad = grads[0]
        if arrays.device_of(grad) != arrays.device_of(first):
            grad = arrays.to_device(grad, arrays.device_of(first))
        with arrays.device_context(arrays.device_of(first)):
            self._updater(param.name, grad, first)
        for replica in replicas[1:]:
            arrays.copy_into(replica, first)

    def _gather_grads(self, grads: Any) -> list[list[Any]]:
        if grads is None:
            lists = [p.list_grad() for p in self._params]
            missing = [p.name for p, g in zip(self._params, lists) if g is None]
            if missing:
                raise ValueError(
                    f"parameters {', '.join(map(repr, missing))} have no gradient: pass grads to step(), "
                    "or make sure they were used in the backward pass"
                )
        elif isinstance(grads, Mapping):
            names = set(self._index)
            missing = [p.name for p in self._params if p.name not in grads]
            extra = [k for k in grads if k not in names]
            if missing or extra:
                raise ValueError(
                    f"the gradients do not match the parameters: missing {missing or 'none'}, "
                    f"unknown {extra or 'none'}"
                )
            lists = [as_list(grads[p.name]) for p in self._params]
        elif isinstance(grads, Sequence):
            if len(grads) != len(self._params):
                raise ValueError(f"{len(grads)} gradients were given for {len(self._params)} parameters")
            lists = [as_list(g) for g in grads]
        else:
            raise TypeError(f"grads must be a mapping, a sequence or None, got {type(grads).__name__}")
        lists = [[from_framework(a, p.name) for a in g] for p, g in zip(self._params, lists)]
        # Checked before anything is pushed, so that a bad gradient leaves every weight as it was.
        for p, g in zip(self._params, lists):
            if len(g) != len(p.list_data()):
                raise ValueError(
                    f"parameter {p.name!r} has {len(p.list_data())} replicas but {len(g)} gradients were given"
                )
            weight = p.list_data()[0]
            for i, grad in enumerate(g):
                if tuple(grad.shape) != tuple(weight.shape):
                    raise ShapeMismatchError(
                        f"parameter {p.name!r} has shape {tuple(weight.shape)}, but its gradient {i} has "
                        f"shape {tuple(grad.shape)}"
                    )
                if grad.dtype != weight.dtype:
                    raise DTypeMismatchError(
                        f"parameter {p.name!r} has dtype {weight.dtype}, but its gradient {i} has dtype {grad.dtype}"
                    )
        return lists

    def _set_compression(self, compression_params: dict[str, Any]) -> None:
        """Turn on the store's gradient compression, after checking every parameter is float32."""
        others = [p for p in self._params if p.list_data()[0].dtype != np.float32]
        if others:
            names = ", ".join(f"{p.name!r} ({p.list_data()[0].dtype})" for p in others[:5])
            raise DTypeMismatchError(
                f"gradient compression is only supported for float32 parameters, but {len(others)} "
                f"are not: {names}"
            )
        self._kv.set_gradient_compression(compression_params)

    def _require_local_update(self, op: str) -> None:
        if self._update_on_kvstore:
            raise ValueError(f"{op}() needs update_on_kvstore=False: here the optimizer runs in the store")

    def _wait_all(self, handles: Iterable[Any]) -> None:
        for handle in handles:
            handle.wait(self._timeout)

    def __repr__(self) -> str:
        return (
            f"Trainer({len(self._params)} params, {self._optimizer!r}, kvstore={self._kv.type!r}, "
            f"update_on_kvstore={self._update_on_kvstore})"
        )


def _plan_groups(params: list[Parameter], limit: int) -> list[tuple[list[int], int]]:
    """Consecutive parameters under ``limit`` bytes, packed up to ``limit`` bytes: ``(indices, priority)``.

    Order is kept, so the first layers still go first; a group takes its first member's priority.
    """
    groups: list[tuple[list[int], int]] = []
    current: list[int] = []
    size = 0
    for i, p in enumerate(params):
        nbytes = int(p.list_data()[0].nbytes)
        if current and (nbytes >= limit or size + nbytes > limit):
            groups.append((current, -current[0]))
            current, size = [], 0
        if nbytes >= limit:
            groups.append(([i], -i))
            continue
        current.append(i)
        size += nbytes
    if current:
        groups.append((current, -current[0]))
    return groups
