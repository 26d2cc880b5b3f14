"""Level 1: aggregation of one key's pushes across the devices of this process.

Rounds: the n-th push of a key by each device belongs to round n; round n is complete when every
device has pushed its n-th value (strict BSP inside the process). Round 0 is the key's initial
value, when there is one (the weights, with ``update_on_server=1``).

Buffers are double-buffered by round parity ("versions" 0 and 1), as in mshadow-ps: the devices can
copy round n+1 in while round n is still being read by pulls. A version is reused for round n+2 only
once round n was published and every pull reading it has finished copying, so no pull ever sees a
half-written buffer.

Where the sum is computed:

* CPU slots: each device's push lands in row ``i`` of one host buffer ``(ndev, *shape)``; the rows
  are added into row 0 with numpy, in device order (so results are reproducible).
* GPUs: each device's push lands in a buffer on its own GPU. With several GPUs and NCCL, one
  all-reduce leaves the sum on every GPU and each device pulls from its own; without NCCL (or for
  a dtype NCCL cannot reduce) the buffers are peer-copied to the first device and added there
  with CuPy, on the stream of the push thread that completed the round (never the first device's
  default stream, where the training kernels queue).
* ``gather``: rows of one buffer on the first device, pulled whole as ``(ndev * shape[0], ...)``.

Every buffer is allocated once, at ``init_key``, on the declaring thread, which then waits for its
stream: the push threads write the buffers on streams of their own, which do not order with the
stream the memory pool handed the blocks out on.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np

from .. import arrays
from .errors import ConfigError

__all__ = ["KeyState", "PullRequest", "Level1Buffers", "nccl_group"]


@dataclass
class PullRequest:
    """One ``pull_req`` of a key by a device, from the call until its copy and callback finished."""

    data: Any
    wid: int
    need_round: int
    priority: int
    callback: Callable[[], Any] | None
    event: Any = None  # recorded at pull_req: the copy waits for the caller's earlier work on data
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    reported: bool = False
    version: int | None = None


def nccl_group(mode: str, use_gpu: bool, ids: list[int]) -> "arrays.NcclGroup | None":
    """The NCCL group Level 1 sums with, for the ``nccl`` parameter ``mode``; None to sum without.

    Only several GPUs use one. Under 'auto' a missing libnccl means none, and a group that fails to
    start means none with a warning; under 'on' either is a ``ConfigError`` naming the cause.
    """
    if not use_gpu or len(ids) < 2 or mode == "off":
        return None
    if not arrays.nccl_available():
        if mode == "on":
            raise ConfigError(
                "set_param('nccl', 'on') was given, but CuPy's NCCL binding is not usable here "
                "(libnccl missing? pip install 'pslaunch[gpu]' installs nvidia-nccl-cu12)"
            )
        return None
    try:
        return arrays.NcclGroup(ids)
    except Exception as exc:
        if mode == "on":
            raise ConfigError(f"set_param('nccl', 'on') was given, but {exc}") from exc
        warnings.warn(
            f"{exc}; Level 1 sums on gpu({ids[0]}) with peer copies instead (set_param('nccl', 'off') "
            "skips NCCL, 'on' makes this an error)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


class Level1Buffers:
    """The per-version buffers one key's pushes are copied into and combined in."""

    def __init__(
        self,
        devices: list[arrays.Device],
        shape: tuple[int, ...],
        dtype: np.dtype,
        op: str,
        nccl: "arrays.NcclGroup | None",
    ) -> None:
        self.devices = devices
        self.shape = shape
        self.dtype = dtype
        self.op = op
        self.nccl = nccl
        self.root = devices[0]
        # Host rows for CPU slots and for gather; one array per device for a GPU sum.
        self._rows_layout = op == "gather" or not self.root.is_gpu
        self._use_nccl = nccl is not None and not self._rows_layout and arrays.nccl_supports(dtype)
        self._versions: list[Any] = [None, None]
        self._scratch: list[Any] = [None, None]

    @property
    def result_shape(self) -> tuple[int, ...]:
        """Shape of what a pull of this key receives."""
        if self.op == "gather":
            first = self.shape[0] if self.shape else 1
            return (len(self.devices) * first,) + tuple(self.shape[1:])
        return self.shape

    def allocate(self) -> None:
        """Create both versions' buffers (and the first device's scratches) and wait until they exist.

        ``empty``, not ``zeros``: a round reads a slot only after its device's push overwrote it
        whole, and a fill queued here could land after that copy.
        """
        for version in (0, 1):
            if self._rows_layout:
                self._versions[version] = arrays.empty((len(self.devices),) + self.shape, self.dtype, self.root)
            else:
                self._versions[version] = [arrays.empty(self.shape, self.dtype, dev) for dev in self.devices]
            if not self._rows_layout and len(self.devices) > 1 and not self._use_nccl:
                self._scratch[version] = arrays.empty(self.shape, self.dtype, self.root)
        for device in self.devices:
            arrays.synchronize_stream(device)

    def slot(self, version: int, wid: int) -> Any:
        """The buffer device ``wid`` copies its push into for rounds of this version."""
        buffers = self._versions[version]
        # [wid, ...] keeps a 0-d row a writable view (plain [wid] would give a numpy scalar)
        return buffers[wid, ...] if self._rows_layout else buffers[wid]

    def reduce(self, version: int) -> list[Any]:
        """Combine the pushes of a complete round; return, per device, the array its pulls copy from.

        Runs on the caller's current stream of the first device (NCCL on the group's streams);
        the result is complete when it returns.
        """
        buffers = self._versions[version]
        count = len(self.devices)
        if self.op == "gather":
            whole = buffers.reshape(self.result_shape)
            return [whole] * count
        if self._rows_layout:
            total = buffers[0, ...]
            with arrays.device_context(self.root):
                for i in range(1, count):
                    total += buffers[i, ...]
            return [total] * count
        if count == 1:
            return [buffers[0]]
        if self._use_nccl:
            self.nccl.allreduce_sum(buffers)
            return list(buffers)
        return [self._reduce_at_root(buffers, self._scratch[version])] * count

    def _reduce_at_root(self, buffers: list[Any], scratch: Any) -> Any:
        # A scratch per version: rounds n and n+1 of a key can complete at once on two push threads
        # (a higher priority lets a device's push of round n+1 run before its push of round n).
        total = buffers[0]
        with arrays.device_context(self.root):
            for other in buffers[1:]:
                arrays.peer_copy(scratch, other)
                total += scratch
            arrays.synchronize_stream(self.root)
        return total


class KeyState:
    """Everything the model tracks for one key; guarded by the model's condition variable.

    Attributes:
        registered: device indices that ran ``init_key`` for the key.
        pushed: per device, how many pushes it made (the round its latest push belongs to).
        version_round / version_state / arrived / readers: per version, the round it holds, its
            state ('free', 'collecting', 'reducing', 'published'), how many devices copied in, and
            how many pulls are copying out of it.
        published_round / published_version / published_ok: the latest round whose result pulls
            can read, where it is, and whether that version is still readable (False once the
            version was taken for a newer round).
        sources: per version, per device, the array pulls copy from.
        requests: per device, its latest pull request.
        deferred: push tasks whose version still holds round n-2; re-queued when it frees.
        error: the failure that stops the key (a copy, the updater, Level 2).
    """

    def __init__(self, key: Hashable, shape: tuple[int, ...], dtype: np.dtype, buffers: Level1Buffers) -> None:
        count = len(buffers.devices)
        self.key = key
        self.shape = shape
        self.dtype = dtype
        self.buffers = buffers
        self.registered: set[int] = set()
        self.pushed = [0] * count
        self.version_round = [-1, -1]
        self.version_state = ["free", "free"]
        self.arrived = [0, 0]
        self.readers = [0, 0]
        self.published_round = -1
        self.published_version: int | None = None
        self.published_ok = False
        self.sources: list[list[Any] | None] = [None, None]
        self.requests: list[PullRequest | None] = [None] * count
        self.error: BaseException | None = None
        self.deferred: list[Any] = []  # push tasks parked until their version is free again

    @property
    def ndev(self) -> int:
        """Number of devices of the model."""
        return len(self.pushed)

    def can_claim(self, version: int, round_no: int) -> bool:
        """True when a device may copy its push for ``round_no`` into ``version`` now."""
        if self.version_round[version] == round_no:
            return self.version_state[version] == "collecting"
        if self.version_round[version] > round_no:
            return False
        return self.version_state[version] in ("free", "published") and self.readers[version] == 0

    def claim(self, version: int, round_no: int) -> None:
        """Start collecting ``round_no`` in ``version`` (no-op when it already does)."""
        if self.version_round[version] == round_no:
            return
        if self.published_version == version:
            self.published_ok = False
        self.version_round[version] = round_no
        self.version_state[version] = "collecting"
        self.arrived[version] = 0
        self.sources[version] = None

    def missing_devices(self, round_no: int) -> list[int]:
        """Device indices that have not pushed for ``round_no`` yet."""
        return [wid for wid, count in enumerate(self.pushed) if count < round_no]
