"""Allreduce of a small value: every worker sends its whole value to every other one.

One hop: a worker's result is ready as soon as the others' values arrived, which is what a
latency-bound value (a few elements, a fused group of small keys) needs. Every worker sums the
values in rank order, so every worker gets the same bits. Values are copied into the messages
(they are small), so the caller's array is free as soon as the op started.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psnode.errors import ProtocolError

from .base import Op, Tag
from .wire import Desc, Kind, Record

__all__ = ["DirectAllreduce"]

_DIRECT = int(Kind.DIRECT)


class DirectAllreduce(Op):
    """Sum ``buf`` (flat) over every worker, in place (see the module docstring)."""

    kind = "direct"

    def __init__(self, engine: Any, tag: Tag, desc: Desc, label: str, buf: np.ndarray) -> None:
        super().__init__(engine, tag, desc, label)
        self.buf = buf
        self.parts: dict[int, np.ndarray] = {}

    def start(self) -> None:
        engine = self.engine
        me, size = engine.rank, engine.size
        if size == 1:
            self.finished = True
            self.complete()
            return
        payload = self.buf.tobytes()
        for rank in range(size):
            if rank != me:
                self.send(rank, Kind.DIRECT, count=self.desc.total, data=payload)
        self.parts[me] = np.frombuffer(payload, self.desc.dtype)

    def on_message(self, src: int, record: Record, data: Any) -> None:
        if record.kind != _DIRECT or record.offset or record.count != self.desc.total or src in self.parts:
            raise ProtocolError(f"worker {src} sent an unexpected message (kind {record.kind}, elements "
                                f"{record.offset}+{record.count}) for {self.describe()}")
        self.parts[src] = np.frombuffer(data, self.desc.dtype, record.count)
        if len(self.parts) < self.engine.size:
            return
        buf, parts = self.buf, self.parts
        np.add(parts[0], parts[1], out=buf)
        for rank in range(2, self.engine.size):
            np.add(buf, parts[rank], out=buf)
        self.parts.clear()
        self.finished = True
        self.complete()

    def waiting_for(self) -> set[int]:
        return set(range(self.engine.size)) - set(self.parts) if not self.finished else set()
