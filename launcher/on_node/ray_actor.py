"""What runs on a Ray node: one ``ProcessActor`` per process of the job, in the process's bundle.

The actor starts its process under the remote guard (``launcher.on_node.guard``), as the
ssh backend does on its hosts: the environment (the job key and ``--env`` values among it) goes in
on the guard's stdin, never on a command line; the key reaches the process on a file descriptor
(``PSLAUNCH_JOB_KEY_FD``); the process runs in a session of its own; the guard reports its pid as a
marker line. The actor keeps the guard's stdin open: when the actor dies (``ray.kill``, its node
leaving the cluster, its worker killed) the guard reads EOF and stops the process's group (TERM,
the grace period, KILL), so no process outlives its actor.

Output is read by two threads into a bounded buffer (``OutputBuffer``) that pslaunch drains with
``read``; a full buffer stops the readers, and so the process's writes, until pslaunch has read:
nothing is dropped. Methods run on a small thread pool (the actor is created with
``max_concurrency``): ``read`` waits while ``tell`` signals. Imports pslaunch's own modules and
never Ray at import time: pslaunch must be installed on the nodes (its runtime runs there anyway).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from .children import READ_SIZE, child_environ, widen_pipe
from .guard import env_payload, guard_argv
from .process_groups import VERBS

__all__ = ["ProcessActor", "OutputBuffer", "BUFFER_BYTES"]

#: Bytes of output an actor holds for pslaunch before its process's writes wait.
BUFFER_BYTES = 8 << 20


class OutputBuffer:
    """Chunks of a process's stdout and stderr in arrival order, at most ``limit`` bytes held.
    Thread-safe: the readers ``put``, pslaunch's ``read`` calls ``take``."""

    def __init__(self, limit: int = BUFFER_BYTES) -> None:
        self._limit = limit
        self._chunks: list[tuple[str, bytes]] = []
        self._held = 0
        self._open = 2  # streams not at EOF yet
        self._cond = threading.Condition()

    def put(self, stream: str, data: bytes) -> None:
        """Append ``data`` of ``stream``; blocks while the buffer is full."""
        with self._cond:
            while self._held >= self._limit:
                self._cond.wait()
            self._chunks.append((stream, data))
            self._held += len(data)
            self._cond.notify_all()

    def close_stream(self) -> None:
        """One stream reached EOF."""
        with self._cond:
            self._open -= 1
            self._cond.notify_all()

    def take(self, wait: float, ended) -> tuple[dict[str, bytes], bool]:
        """Everything held, by stream (waiting up to ``wait`` s for some), and whether both streams
        are at EOF, nothing is held and ``ended()`` (the guard exited)."""
        deadline = time.monotonic() + wait
        with self._cond:
            while not self._chunks and not (self._open == 0 and ended()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))  # ended() is the guard's state: look again now and then
            parts: dict[str, list[bytes]] = {}
            for stream, data in self._chunks:
                parts.setdefault(stream, []).append(data)
            out = {stream: b"".join(chunks) for stream, chunks in parts.items()}
            self._chunks, self._held = [], 0
            self._cond.notify_all()
            return out, self._open == 0 and ended()


class ProcessActor:
    """Starts and watches one process of the job on this node (see the module docstring).
    Created by ``launcher.backends.ray.backend`` with ``ray.remote``; each method is a remote call."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen | None = None
        self._buffer: OutputBuffer | None = None
        self._lock = threading.Lock()

    def where(self) -> dict:
        """Where this actor runs: ``{"ip": its node's Ray address}``."""
        import ray

        return {"ip": ray.util.get_node_ip_address()}

    def free_port(self, wanted: int) -> int:
        """``wanted`` when no socket of this node holds it, else a port free now (for the scheduler,
        or torch's process group)."""
        for port in (wanted, 0):
            with socket.socket() as sock:
                try:
                    sock.bind(("0.0.0.0", port))
                except OSError:
                    continue
                return sock.getsockname()[1]
        raise OSError("no free port")

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, grace: float,
              launcher_python: str | None) -> int:
        """Start ``argv`` with the contract ``env`` (a secret: it holds the job key) in ``cwd`` (None:
        Ray's working directory; a directory is first filled with a copy of it, ``--sync-dst-dir``);
        ``launcher_python``: a first word to replace with this node's Python. Returns the guard's
        pid. Raises ``OSError`` when the guard cannot start."""
        argv = list(argv)
        if launcher_python and argv and argv[0] == launcher_python:
            argv[0] = sys.executable
        if cwd:
            _copy_working_dir(cwd)
        with self._lock:
            if self._popen is not None and self._popen.poll() is None and self._popen.stdin is not None:
                self._popen.stdin.close()  # an earlier attempt's guard: at EOF it stops its group
            buffer = OutputBuffer()
            # no link timeout (the actor's life is the link); cwd strict
            popen = subprocess.Popen(guard_argv(argv, cwd, bool(cwd), grace), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=child_environ({}, base=dict(os.environ)))
            assert popen.stdin is not None
            popen.stdin.write(env_payload(env))
            popen.stdin.flush()
            for stream, pipe in (("stdout", popen.stdout), ("stderr", popen.stderr)):
                widen_pipe(pipe.fileno())
                threading.Thread(target=_pump, args=(pipe, stream, buffer), daemon=True,
                                 name=f"pslaunch-{stream}").start()
            self._popen, self._buffer = popen, buffer
            return popen.pid

    def read(self, wait: float) -> dict:
        """``{"out": {stream: bytes}, "done": bool, "code": int | None}``: the output since the last
        call, waiting up to ``wait`` s for some; once the guard exited and every byte was read,
        ``done`` and its exit code (the process's; 128 + n for a signal)."""
        popen, buffer = self._popen, self._buffer
        if popen is None or buffer is None:
            return {"out": {}, "done": False, "code": None}
        out, done = buffer.take(wait, lambda: popen.poll() is not None)
        return {"out": out, "done": done, "code": popen.returncode if done else None}

    def tell(self, verb: str) -> None:
        """Pass ``verb`` (TERM, KILL, STOP, CONT, END) to the guard, which signals the group."""
        popen = self._popen
        if verb not in VERBS or popen is None or popen.poll() is not None:
            return
        with self._lock:  # calls run on several threads; the guard reads whole lines
            try:
                assert popen.stdin is not None
                popen.stdin.write(verb.encode() + b"\n")
                popen.stdin.flush()
            except (OSError, ValueError):
                pass  # the guard is gone: so is its group


def _pump(pipe, stream: str, buffer: OutputBuffer) -> None:
    try:
        while True:
            try:
                data = os.read(pipe.fileno(), READ_SIZE)
            except OSError:
                break
            if not data:
                break
            buffer.put(stream, data)
    finally:
        buffer.close_stream()
        pipe.close()


def _copy_working_dir(target: str) -> None:
    """Copy this actor's working directory (Ray's copy of pslaunch's) into ``target``, one actor of
    the node at a time (a lock on ``target`` itself, which leaves no file): the processes of a node
    share it."""
    source = os.getcwd()
    if os.path.realpath(source) == os.path.realpath(target):
        return
    os.makedirs(target, exist_ok=True)
    folder = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        shutil.copytree(source, target, dirs_exist_ok=True)
    finally:
        os.close(folder)  # and with it the lock
