"""Data-parallel helpers: split a batch across a worker's devices, split a dataset across workers.

Data parallelism has two levels, as in MXNet's distributed examples: the dataset is split across
*workers* by their rank (``SplitSampler``), and each worker splits its batch across its own
*devices* (``split_and_load``). With ``SplitSampler``'s strided parts, ``n`` workers that each take
``B / n`` samples per step see together exactly the batches one worker taking ``B`` per step sees.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from . import arrays
from .arrays import Device

__all__ = ["split_and_load", "split_data", "SplitSampler"]


def _as_devices(devices: Any) -> list[Device]:
    """One Device, a device string, or a sequence of either -> a non-empty list of Devices."""
    if isinstance(devices, (Device, str)):
        devices = [devices]
    result = [Device.parse(d) if isinstance(d, str) else d for d in devices]
    if not result:
        raise ValueError("split_and_load needs at least one device; got an empty list")
    for d in result:
        if not isinstance(d, Device):
            raise TypeError(f"devices must be kvcore.Device objects or strings like 'gpu:0', got {d!r}")
    return result


def split_data(data: Any, num_slice: int, batch_axis: int = 0, even_split: bool = True) -> list[Any]:
    """Split ``data`` along ``batch_axis`` into ``num_slice`` views (no copies).

    With ``even_split`` the batch size must be a multiple of ``num_slice``; without it, the first
    ``size % num_slice`` slices get one sample more than the others.

    Raises:
        ValueError: the batch does not split (naming the batch size and the slice count), or
            ``batch_axis`` is outside the array's dimensions.
    """
    ndim = getattr(data, "ndim", None)
    if ndim is None:
        raise TypeError(f"data must be a numpy or CuPy array, got {type(data).__name__}")
    if not -ndim <= batch_axis < ndim:
        raise ValueError(f"batch_axis {batch_axis} is out of range for data of shape {tuple(data.shape)}")
    if num_slice < 1:
        raise ValueError(f"num_slice must be at least 1, got {num_slice}")
    size = int(data.shape[batch_axis])
    if even_split and size % num_slice:
        raise ValueError(
            f"a batch of size {size} (axis {batch_axis} of shape {tuple(data.shape)}) cannot be split "
            f"evenly across {num_slice} devices; use a batch size that is a multiple of {num_slice}, "
            "or even_split=False"
        )
    if size < num_slice:
        raise ValueError(
            f"a batch of size {size} cannot give each of {num_slice} devices at least one sample"
        )
    if num_slice == 1:
        return [data]
    base, extra = divmod(size, num_slice)
    slices = []
    start = 0
    for i in range(num_slice):
        stop = start + base + (1 if i < extra else 0)
        index = [slice(None)] * ndim
        index[batch_axis] = slice(start, stop)
        slices.append(data[tuple(index)])
        start = stop
    return slices


def split_and_load(data: Any, devices: Any, batch_axis: int = 0, even_split: bool = True) -> list[Any]:
    """Split ``data`` along ``batch_axis`` and place one slice on each device (MXNet's gluon helper).

    ``devices`` is a ``Device``, a string (``'cpu'``, ``'gpu:1'``) or a sequence of them. With one
    device the whole batch goes to it, unsplit (and uncopied when it already lives there). Slices
    that already live on their device are views of ``data``, not copies; slices for another device
    are copies made with ``kvcore.arrays.to_device``.

    Returns:
        A list with one array per device, in the order of ``devices``.

    Raises:
        ValueError: with ``even_split``, the batch size is not a multiple of the number of devices
            (the message names both); or a batch smaller than the number of devices.
    """
    devices = _as_devices(devices)
    slices = split_data(data, len(devices), batch_axis, even_split)
    return [arrays.to_device(s, d) for s, d in zip(slices, devices)]


class SplitSampler:
    """The sample indices of one part of a dataset: the share of one worker among ``num_parts``.

    Every epoch draws one permutation of ``range(length)`` from ``(seed, epoch)``; part ``k`` takes
    every ``num_parts``-th index of it starting at ``k``. So the parts of an epoch are disjoint and
    together cover the dataset, every part is reshuffled each epoch, and with a per-part batch of
    ``B / num_parts`` the union of the parts' t-th batches is the t-th batch of size ``B`` that a
    single part would draw: training on ``n`` workers sees the same global batches as on one.

    Every part of one dataset must be built with the same ``length`` and ``seed`` so that they draw
    the same permutation; for that reason ``seed=None`` means seed 0, not a random seed.

    ``drop_last`` cuts the permutation to a multiple of ``num_parts`` first, so that every part has
    exactly ``length // num_parts`` indices (the few left out change every epoch). Synchronous
    training needs the same number of steps on every worker; use it there when ``length`` is not a
    multiple of ``num_parts``. Without it, the first ``length % num_parts`` parts hold one index more.

    The epoch is chosen by ``set_epoch(e)``; otherwise each ``iter()`` uses the next epoch, starting
    at 0. Not thread-safe.

    Raises:
        ValueError: ``length`` < 0, ``num_parts`` < 1, or ``part_index`` outside ``0..num_parts-1``
            (the message names the values).
    """

    def __init__(
        self, length: int, num_parts: int = 1, part_index: int = 0, seed: int | None = None,
        drop_last: bool = False,
    ) -> None:
        length, num_parts, part_index = int(length), int(num_parts), int(part_index)
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        if not 0 <= part_index < num_parts:
            raise ValueError(
                f"part_index {part_index} is out of range for {num_parts} parts (expected 0..{num_parts - 1})"
            )
        self.length = length
        self.num_parts = num_parts
        self.part_index = part_index
        self.seed = 0 if seed is None else int(seed)
        self.drop_last = bool(drop_last)
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` or ``indices()`` call draws."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Draw the permutation of ``epoch`` next (as torch's DistributedSampler.set_epoch)."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._epoch = epoch

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This part's indices for ``epoch`` (the current epoch when None) as an int64 array.

        Does not advance the epoch.
        """
        epoch = self._epoch if epoch is None else int(epoch)
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.length).astype(np.int64)
        if self.drop_last:
            perm = perm[: self.length - self.length % self.num_parts]
        return perm[self.part_index :: self.num_parts]

    def elastic_batches(self, kv: Any, state: Any, batch_size: int) -> Iterator[np.ndarray]:
        """This worker's batches of indices, step after step, in a job whose workers change (``-n
        MIN:MAX``): every epoch is one permutation (``(seed, epoch)``, as ``indices``); each step the
        members take the next ``num_workers x batch_size`` indices of it, member ``i`` (its
        ``kv.member_index``) every ``num_workers``-th from ``i``. So no index is dropped or taken twice
        in an epoch whatever joins or leaves. The last step of an epoch shares what is left, so a
        member's batch may be shorter, even empty: push its (zero) gradient all the same, every
        member's push closes the round (``drop_last``: that remainder is skipped instead).

        The place is kept in ``state`` (a ``kvcore.elastic.State`` with scalars ``epoch`` and ``seen``,
        the indices of the epoch the members took so far), so a worker that joins or a job that
        resumes goes on from it. It never ends: stop when ``state.epoch`` reaches your epochs.
        ``num_parts`` and ``part_index`` are not used.

        Raises:
            ValueError: ``batch_size`` < 1, an empty dataset, or ``state`` lacks the ``epoch`` and
                ``seen`` scalars.
        """
        if int(batch_size) < 1 or self.length < 1:
            raise ValueError(f"batch_size must be >= 1 and the dataset not empty, got {batch_size} and {self.length}")
        if not all(hasattr(state, name) for name in ("epoch", "seen")):
            raise ValueError("elastic_batches keeps its place in state.epoch and state.seen: create the State "
                             "with epoch=0, seen=0")
        batch_size = int(batch_size)
        perm_epoch, perm = -1, np.empty(0, np.int64)
        while True:
            members, index = kv.num_workers, kv.member_index  # this step's members (its step boundary)
            if perm_epoch != state.epoch:
                perm_epoch = state.epoch
                perm = np.random.default_rng([self.seed, perm_epoch]).permutation(self.length).astype(np.int64)
            step = members * batch_size
            left = self.length - state.seen
            if left <= 0 or (self.drop_last and left < step):
                state.epoch, state.seen = state.epoch + 1, 0
                continue
            take = min(step, left)
            yield perm[state.seen + index: state.seen + take: members]
            state.seen = state.seen + take

    def __iter__(self) -> Iterator[int]:
        part = self.indices()
        self._epoch += 1
        return iter(part.tolist())

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.num_parts
        base, extra = divmod(self.length, self.num_parts)
        return base + (1 if self.part_index < extra else 0)

    def __repr__(self) -> str:
        return (
            f"SplitSampler(length={self.length}, num_parts={self.num_parts}, part_index={self.part_index}, "
            f"seed={self.seed}, drop_last={self.drop_last})"
        )
