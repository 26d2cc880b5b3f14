"""A whole job inside the test's process, on the ``inproc`` transport: no sockets, no processes.

    with InProcJob(num_workers=2, num_servers=1) as job:
        w0, w1 = job.workers                      # started WorkerNodes, by rank
        w0.push([(0, 7, value)]); ...             # the real worker, server and scheduler code
        job.servers[0].store.shards[7]            # and their state, to look at

The scheduler and every server run on threads of their own, exactly their code of a real job
(``Scheduler.run``, ``ServerNode.run``); the workers are ``WorkerNode`` objects with their network
threads, registered before the block starts. ``job.run_script(path)`` runs a kvcore worker script,
unchanged, as every worker at once (a thread each, ``kvcore.runtime.use``): a whole kvcore job in
milliseconds. Each worker's transport is an
``inproc_transport.InProcTransport``: ``record``/``outgoing`` show what it sends, ``full`` makes a
server's queue full. Leaving the block closes the workers (the scheduler then ends the job and the
servers stop) and joins every thread; a node thread that failed unexpectedly fails the test there.
"""

from __future__ import annotations

import io
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence

from pscontract import contract_env
from psnode.env import NodeEnv, read_env
from psnode.node.membership import SCHEDULER
from psnode.scheduler.node import Scheduler
from psnode.server.node import ServerNode
from psnode.transport.inproc import InProcHub, InProcTransport
from psnode.worker.node import WorkerNode

__all__ = ["InProcJob"]

_SETTINGS = {"PS_HEARTBEAT_INTERVAL": "0.5", "PS_HEARTBEAT_TIMEOUT": "10", "PSLAUNCH_REGISTER_TIMEOUT": "10",
             "PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_TRANSPORT": "inproc"}
_JOIN = 10.0  # seconds any thread of the job gets to end


class InProcJob:
    """A job of ``num_workers`` workers and ``num_servers`` servers in this process (see the module docstring).

    ``settings``: values for the contract's settings (``pscontract.SETTINGS``), e.g.
    ``{"PSLAUNCH_BIGARRAY_BOUND": "100"}``; ``expect_failure``: the test makes a node fail on
    purpose, so thread errors are kept in ``errors`` instead of raised; ``network_threads=False``:
    the workers get no network thread, the test's own calls receive (``WorkerNode.start``).
    """

    def __init__(self, num_workers: int, num_servers: int, settings: Mapping[str, str] | None = None,
                 expect_failure: bool = False, network_threads: bool = True) -> None:
        self.hub = InProcHub()
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.settings = {**_SETTINGS, **(settings or {})}
        self.expect_failure = expect_failure
        self.network_threads = network_threads
        self.scheduler: Scheduler | None = None
        self.servers: list[ServerNode] = []
        self.workers: list[WorkerNode] = []
        self.errors: dict[str, BaseException] = {}  # thread name -> what ended it
        self._threads: list[threading.Thread] = []

    def env(self, role: str, rank: int = 0) -> NodeEnv:
        """The contract of one node of this job, as its process would read it."""
        return read_env(contract_env(role=role, root_uri="127.0.0.1", root_port=1, num_workers=self.num_workers,
                                     num_servers=self.num_servers, job_id="inproc", rank=rank, local_rank=rank,
                                     local_size=1, node_host="127.0.0.1", fixed_rank=False, supervised=False, settings=self.settings))

    def transport(self, identity: bytes = b"") -> InProcTransport:
        """A new transport on this job's hub (for a node a test builds itself)."""
        return InProcTransport(identity, hub=self.hub)

    # ---- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "InProcJob":
        try:
            self.scheduler = Scheduler(self.env("scheduler"), transport=self.transport(SCHEDULER))
            self._thread("scheduler", self.scheduler.run)
            for i in range(self.num_servers):
                server = ServerNode(self.env("server", i), transport=self.transport())
                self.servers.append(server)
                self._thread(f"server{i}", server.run)
            workers = [WorkerNode(self.env("worker", i), transport=self.transport()) for i in range(self.num_workers)]
            self.workers = workers
            starting = [self._thread(f"worker{i}-start", lambda w=w: w.start(self.network_threads))
                        for i, w in enumerate(workers)]
            for thread in starting:
                thread.join(_JOIN)
            failed = {name: e for name, e in self.errors.items() if name.endswith("-start")}
            if failed or any(t.is_alive() for t in starting):
                raise RuntimeError(f"the in-process job did not start: {failed or 'a worker did not register'}")
            # A server takes its address book on its own thread, maybe after every worker has its
            # own: sorted by a rank still -1, job.servers[1] could be server 0.
            deadline = time.monotonic() + _JOIN
            while any(s.rank < 0 for s in self.servers):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the in-process job did not start: a server had no rank after {_JOIN:g} s")
                time.sleep(0.005)
            self.workers = sorted(workers, key=lambda w: w.rank)
            self.servers.sort(key=lambda s: s.rank)
        except BaseException:
            self._force_close()
            raise
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        for worker in self.workers:
            try:
                worker.close(timeout=5.0)
            except Exception as exc:  # a failed job: the close reports it, the test already did
                self.errors.setdefault(f"worker{worker.rank}-close", exc)
        # a job failed on purpose ends when its nodes notice (up to a heartbeat timeout): end it now
        deadline = time.monotonic() + (0.5 if self.expect_failure else _JOIN)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads) and not self.expect_failure:
            self._force_close()
            stuck = [t.name for t in self._threads if t.is_alive()]
            if kind is None:
                raise RuntimeError(f"threads of the in-process job did not end: {stuck}")
        self._force_close()
        if kind is None and not self.expect_failure and self.errors:
            raise RuntimeError(f"nodes of the in-process job failed: {self.errors}")

    def run_script(self, path: str | Path, args: Sequence[str] = (), timeout: float = 60.0) -> dict[int, str]:
        """Run the kvcore worker script ``path`` as every worker of this job at once, a thread per
        worker running as its worker (``kvcore.runtime.use``); returns each rank's printed output.

        The script is the same file a ``LocalJob`` starts as a process (``sys.argv`` is ``[path,
        *args]``, and its folder is on ``sys.path``). Raises ``AssertionError`` naming the rank and its traceback when a worker's run
        raised or exited non-zero, or when one still runs after ``timeout`` seconds.
        """
        from kvcore import runtime

        code = compile(Path(path).read_text(), str(path), "exec")
        outputs: dict[int, io.StringIO] = {node.rank: io.StringIO() for node in self.workers}
        failures: dict[int, str] = {}
        stdout = _OutputPerThread(sys.stdout)

        def run(node: WorkerNode) -> None:
            stdout.local.buffer = outputs[node.rank]
            try:
                with runtime.use(node):
                    exec(code, {"__name__": "__main__", "__file__": str(path)})
            except SystemExit as exc:
                if exc.code not in (0, None):
                    failures[node.rank] = f"exited with {exc.code!r}"
            except BaseException:  # reported with the rank below
                failures[node.rank] = traceback.format_exc()

        saved_argv, saved_stdout = sys.argv, sys.stdout
        sys.argv, sys.stdout = [str(path), *args], stdout
        sys.path.insert(0, str(Path(path).resolve().parent))  # as for a script run: its siblings import
        try:
            threads = [threading.Thread(target=run, args=(node,), name=f"inproc-worker{node.rank}-script", daemon=True)
                       for node in self.workers]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + timeout
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        finally:
            sys.argv, sys.stdout = saved_argv, saved_stdout
            sys.path.remove(str(Path(path).resolve().parent))
        printed = {rank: buffer.getvalue() for rank, buffer in outputs.items()}
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            raise AssertionError(f"{path}: {stuck} still ran after {timeout:g} s; printed so far: {printed}")
        if failures:
            rank = min(failures)
            raise AssertionError(f"{path}: worker {rank} failed:\n{failures[rank]}\nprinted: {printed}")
        return printed

    def _thread(self, name: str, target: Any) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # kept for the test: a node thread must not die silently
                self.errors[name] = exc

        thread = threading.Thread(target=run, name=f"inproc-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def _force_close(self) -> None:
        """Close every transport (a node still running ends with ClosedError) and join its thread."""
        for worker in self.workers:
            worker.receiver.stop(join=1.0)
            worker.conn.transport.close()
        for server in self.servers:
            server.conn.transport.close()
        if self.scheduler is not None:
            self.scheduler.transport.close()
        for thread in self._threads:
            thread.join(1.0)


class _OutputPerThread(io.TextIOBase):
    """``sys.stdout`` while scripts run on threads: a thread with a ``local.buffer`` prints into it,
    any other thread where stdout went before."""

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback
        self.local = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return getattr(self.local, "buffer", self.fallback).write(text)

    def flush(self) -> None:
        getattr(self.local, "buffer", self.fallback).flush()
