"""CuPy arrays summed across the workers' processes with NCCL; host staging where NCCL cannot.

**Communicator.** Each worker joins one NCCL communicator (``nccl_group.NcclGroup.joined``) on the
GPU of its first CuPy collective. The unique id comes through the scheduler: worker 0 makes it and
sets it as a rendezvous value (``psnode.scheduler.rendezvous``), the others ask for it. Creating it is
itself collective: every worker joins at its first GPU collective.

**Order.** NCCL requires every process to issue the same collectives in the same order, and a
collective cannot be taken back once issued. Workers may submit in different orders (tagged
asynchronous pushes), so worker 0's order is the order: worker 0 issues its GPU collectives in
the order they are submitted and sends ``GO`` (with the tag and the value's dtype and shape) to
every other worker; the others issue in the order of those ``GO`` messages, each as soon as it is
submitted there too. A ``GO`` whose shape or dtype differs from the local value aborts the
communicator and ends the job through the scheduler, as a crash would (worker 0's kernel already
waits for this worker), every worker naming this one and the two values; any other NCCL failure
aborts the communicator, and later GPU collectives fail with that reason.

**Threads.** One launcher thread per worker issues every NCCL call, waits for the value's
producing work first (an event recorded when it was submitted) and completes the futures; neither
a caller nor the receiving thread ever blocks in NCCL, so heartbeats go on.

**Host staging.** Without a usable NCCL (no libnccl) or for a dtype NCCL does not sum, the value is
copied to the host, summed there by the host collectives, and copied back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from typing import Any, Sequence

import numpy as np

from psnode import devices
from psnode.devices.nccl import NcclGroup, nccl_supports
from psnode.errors import MismatchError, PSNodeError
from psnode.log import logger
from psnode.node.futures import chain
from psnode.node.protocol import Cmd

from .wire import Desc, Kind, Record

__all__ = ["GpuCollectives", "encode_id", "decode_id"]

_ID_KEY = "nccl-unique-id"
_ID_LENGTH = 128  # bytes of ncclUniqueId
_POLL = 0.0005  # seconds between looks at a running NCCL collective


def encode_id(unique_id: Sequence[int]) -> str:
    """NCCL's unique id (CuPy gives 128 small ints) as a rendezvous value."""
    return json.dumps([int(b) for b in unique_id])


def decode_id(text: str) -> tuple[int, ...]:
    """A unique id from a rendezvous value.

    Raises:
        PSNodeError: not a list of 128 ints in -128..255 (naming what it is).
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise PSNodeError(f"the NCCL unique id from the scheduler is not JSON: {exc}") from exc
    if (not isinstance(value, list) or len(value) != _ID_LENGTH
            or not all(isinstance(b, int) and -128 <= b <= 255 for b in value)):
        raise PSNodeError(f"the NCCL unique id from the scheduler is not {_ID_LENGTH} bytes")
    return tuple(value)


class _GpuOp:
    __slots__ = ("tag", "desc", "buffer", "out", "future", "ready", "label")

    def __init__(self, tag: tuple[int, int], desc: Desc, buffer: Any, out: Any, future: Any, label: str) -> None:
        self.tag = tag
        self.desc = desc
        self.buffer = buffer
        self.out = out
        self.future = future
        self.ready = devices.record_event(buffer)  # the work that produced the value, on its stream
        self.label = label


class GpuCollectives:
    """One worker's NCCL collectives (see the module docstring). Made by ``Engine.gpu``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.group: NcclGroup | None = None
        self.device: int | None = None
        self.broken: BaseException | None = None
        self._cond = threading.Condition()
        self._submitted: dict[tuple[int, int], _GpuOp] = {}
        self._order: collections.deque = collections.deque()  # tags in the order they are issued
        self._go_desc: dict[tuple[int, int], tuple[int, int, int]] = {}  # tag -> worker 0's (dtype, total, shape)
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- submitting (callers) ----------------------------------------------------------------------
    def allreduce(self, key: Any, array: Any, out: Any, label: str | None, future: Any, after: Sequence[Any]) -> Any:
        """Sum CuPy ``array`` over every worker into ``out`` (``array`` when None); a future at once."""
        engine = self.engine
        label = label or f"allreduce of key {key!r}"
        if out is not None and (tuple(out.shape) != tuple(array.shape) or out.dtype != array.dtype):
            raise ValueError(f"allreduce of {array.dtype} of shape {tuple(array.shape)} into an out of "
                             f"{out.dtype} of shape {tuple(out.shape)}")
        if devices.nccl_module() is None or not nccl_supports(array.dtype):
            return self._staged(key, array, out, label, future, after)
        desc = Desc(array.dtype, array.shape)
        target = array if out is None else out
        if not target.flags.c_contiguous:
            raise ValueError("NCCL sums C-contiguous CuPy arrays; pass a contiguous out")
        if target is not array:
            devices.copy_into(target, array)
        op = _GpuOp(engine.next_tag(key), desc, target, out, future or concurrent.futures.Future(), label)
        with self._cond:
            self._submitted[op.tag] = op
            if engine.rank == 0:
                self._order.append(op.tag)
            self._cond.notify_all()
        if engine.rank == 0:
            for rank in range(engine.size):
                if rank:
                    try:
                        engine.send(rank, _go(op), False)
                    except PSNodeError as exc:
                        self._fail(op, exc)
        self._ensure_thread()
        return op.future

    def _staged(self, key: Any, array: Any, out: Any, label: str, future: Any, after: Sequence[Any]) -> Any:
        """Host staging: download, sum on the host, upload into ``out`` (or ``array``) when done."""
        host = np.ascontiguousarray(devices.asnumpy(array))
        target = array if out is None else out
        inner = self.engine.allreduce(key, host, label=label, after=after)
        return chain(inner, future or concurrent.futures.Future(),
                     lambda: devices.copy_into(target, host.reshape(target.shape)))

    # ---- ordering (the receiving thread) ---------------------------------------------------------------
    def on_go(self, src: int, tag: tuple[int, int], record: Record) -> None:
        """Worker 0 issued the GPU collective ``tag``: issue it next here."""
        if src != 0 or self.engine.rank == 0:
            logger.info("worker %d dropped a GPU order from worker %d (only worker 0 orders)", self.engine.rank, src)
            return
        with self._cond:
            if len(self._order) >= 100_000:
                logger.info("worker %d dropped a GPU order: %d are waiting already", self.engine.rank, len(self._order))
                return
            self._order.append(tag)
            self._go_desc[tag] = (record.dtype, record.total, record.shape)
            self._cond.notify_all()
        self._ensure_thread()

    # ---- the launcher thread ----------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"psnode-nccl-{self.engine.rank}", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not (self._order and self._order[0] in self._submitted):
                    self._cond.wait(0.1)
                if self._stop:
                    return
                tag = self._order.popleft()
                op = self._submitted.pop(tag)
                theirs = self._go_desc.pop(tag, None)
            if self.broken is not None:
                self._fail(op, self.broken)
                continue
            if theirs is not None and theirs != (op.desc.code, op.desc.total, op.desc.crc):
                error = MismatchError(
                    f"{op.label} (version {tag[1]}): worker 0 passed a GPU value of {theirs[1]} elements (dtype code "
                    f"{theirs[0]}), but worker {self.engine.rank} passed {op.desc}; every worker must pass the same "
                    "shape and dtype")
                self._break(error)
                self._fail(op, error)
                continue
            try:
                self._launch(op)
            except PSNodeError as exc:
                self._break(exc)
                self._fail(op, exc)
            except Exception as exc:
                error = PSNodeError(f"{op.label} failed in NCCL on worker {self.engine.rank}: {type(exc).__name__}: {exc}")
                self._break(error)
                self._fail(op, error)

    def _launch(self, op: _GpuOp) -> None:
        device = devices.device_of(op.buffer).index
        if self.group is None:
            self.group = self._join(device)
            self.device = device
        elif device != self.device:
            raise PSNodeError(f"{op.label}: worker {self.engine.rank} sums GPU values on gpu({self.device}); this one "
                              f"lives on gpu({device})")
        if op.ready is not None:
            op.ready.synchronize()
        self.group.allreduce_sum([op.buffer])
        try:
            op.future.set_result(None)
        except Exception:  # failed meanwhile
            pass

    def _join(self, device: int) -> NcclGroup:
        """Agree on the unique id through the scheduler and join the communicator (blocking)."""
        engine = self.engine
        link = engine.conn.link
        if engine.rank == 0:
            text = encode_id(devices.nccl_module().get_unique_id())
            future = link.ask(Cmd.RDV_SET, body={"key": _ID_KEY, "value": text})
        else:
            future = link.ask(Cmd.RDV_GET, body={"key": _ID_KEY})
        limit = max(60.0, engine.conn.env.heartbeat_timeout)
        deadline = time.monotonic() + limit
        while not future.done():
            if engine.failure is not None:
                raise PSNodeError(f"worker {engine.rank} failed before NCCL started: {engine.failure}")
            if time.monotonic() > deadline:
                raise PSNodeError(f"worker {engine.rank} got no NCCL unique id through the scheduler within {limit:g} s")
            time.sleep(0.01)
        unique_id = decode_id(future.result())
        try:
            return NcclGroup.joined(device, unique_id, engine.size, engine.rank)
        except RuntimeError as exc:
            raise PSNodeError(str(exc)) from exc

    # ---- failure ------------------------------------------------------------------------------------------
    def _fail(self, op: _GpuOp, error: BaseException) -> None:
        try:
            op.future.set_exception(error)
        except Exception:
            pass

    def _break(self, error: BaseException) -> None:
        """NCCL cannot be trusted on this worker any more: abort the communicator. A mismatch ends
        the job through the scheduler (as a worker's crash does), so that worker 0, whose kernel
        waits for this worker, fails too, naming it and the reason."""
        first = self.broken is None
        if first:
            self.broken = error
        if self.group is not None:
            self.group.abort()
        if first and isinstance(error, MismatchError):
            self.engine.conn.link.send(Cmd.NODE_DIED, body={"message": str(error)})
            self.engine.conn.failure.fail(error)

    def fail_all(self, error: BaseException) -> None:
        """The worker failed: fail every GPU collective submitted and abort the communicator."""
        self._break(error)
        with self._cond:
            ops = list(self._submitted.values())
            self._submitted.clear()
            self._cond.notify_all()
        for op in ops:
            self._fail(op, error)

    def close(self) -> None:
        """Stop the launcher thread and release the communicator."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self.group is not None:
            self.group.close()


def _go(op: _GpuOp) -> list:
    from .wire import pack

    return pack(op.tag[0], op.tag[1], Kind.GO, op.desc)
