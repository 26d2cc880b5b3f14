"""Simulated nodes spread over processes: each process builds its share and runs the phases it is told.

``benchmarks.scheduler_scale`` and ``benchmarks.server_scale`` simulate hundreds or thousands of nodes
with real sockets, more than one process's open files allow: ``Simulators(make, count, per_process)``
forks a process per ``per_process`` indices, each of which builds ``make(indices)`` (an object whose
methods are the phases, plus ``close``) and answers ``run(phase, arg)`` with that method's result.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

__all__ = ["Simulators"]


def _serve(conn: Any, make: Callable[[range], Any], indices: range) -> None:
    """A simulator process: build its nodes, run the phases its parent names, answer each one's result."""
    sim = make(indices)
    conn.send("ready")
    try:
        while True:
            phase, arg = conn.recv()
            if phase == "close":
                return
            try:
                conn.send(("ok", getattr(sim, phase)(arg)))
            except Exception as exc:  # the parent reports it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        sim.close()


class Simulators:
    """``count`` simulated nodes, ``per_process`` per process at most (see the module docstring)."""

    def __init__(self, make: Callable[[range], Any], count: int, per_process: int, what: str,
                 start_timeout: float = 120, phase_timeout: float = 900) -> None:
        self.what = what
        self.phase_timeout = phase_timeout
        ctx = multiprocessing.get_context("fork")  # ``make`` is inherited, never pickled
        self.pipes, self.procs = [], []
        for first in range(0, count, per_process):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, make, range(first, min(count, first + per_process))),
                               daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
        for pipe in self.pipes:
            if not pipe.poll(start_timeout):
                raise TimeoutError(f"{what}: a simulator process did not start within {start_timeout:g} s")
            assert pipe.recv() == "ready"

    def run(self, phase: str, arg: object = None, only_first: bool = False) -> list:
        """Run ``phase`` in every simulator process at once (or the first only); their results in order.

        Raises:
            RuntimeError: a phase raised (the message has its error); TimeoutError: no answer in time.
        """
        pipes = self.pipes[:1] if only_first else self.pipes
        for pipe in pipes:
            pipe.send((phase, arg))
        results = []
        for pipe in pipes:
            if not pipe.poll(self.phase_timeout):
                raise TimeoutError(f"{self.what}, phase {phase}: no answer in {self.phase_timeout:g} s")
            status, value = pipe.recv()
            if status != "ok":
                raise RuntimeError(f"{self.what}, phase {phase}: {value}")
            results.append(value)
        return results

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("close", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
