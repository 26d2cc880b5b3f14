"""The psnode tests' kit: in-process jobs, and reading what a worker sent.

Everything here runs on the ``inproc`` transport (``testkit.InProcJob``): real scheduler,
server and worker code, no sockets and no processes, so a test takes milliseconds.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from psnode.node.protocol import unpack_entries, unpack_header
from testkit import InProcJob

__all__ = ["InProcJob", "init_keys", "on_threads", "sent", "sent_headers", "sent_keys"]


def on_threads(*calls: Callable[[], Any], timeout: float = 10.0) -> list[Any]:
    """Run ``calls`` at once, each on a thread of its own (a barrier needs every worker); their results.

    Raises what a call raised, or TimeoutError when one did not return in time.
    """
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"a call did not return within {timeout} s")
    if errors:
        raise errors[0]
    return results


def init_keys(job: InProcJob, keys: dict[int, tuple[int, np.ndarray]], sync: bool = True) -> None:
    """Initialise ``{key id: (server, value)}`` from worker 0 and pass a barrier of every worker."""
    first = job.workers[0]
    future = first.init([(server, key, key, value, 1) for key, (server, value) in keys.items()], sync)
    assert first.wait_for(future, 10)
    future.result()
    on_threads(*(w.barrier for w in job.workers))


def sent(worker: Any) -> list[tuple[bytes, list[bytes]]]:
    """Every message ``worker`` sent to a server while its transport recorded, as ``(peer, frames)``."""
    return [(peer, frames) for peer, frames in worker.conn.transport.outgoing if peer != b"scheduler"]


def sent_headers(worker: Any) -> list[tuple[int, int, int, int]]:
    """``(cmd, flags, req_id, arg)`` of every message ``worker`` sent to a server."""
    return [unpack_header(frames[0]) for _, frames in sent(worker)]


def sent_keys(frames: list[bytes]) -> list[int]:
    """The key ids of a data message's parts, in message order."""
    return [entry[0] for entry in unpack_entries(frames[1])]
