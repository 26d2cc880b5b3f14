"""Helpers shared by the shared-model tests.

A module with its own name (not ``conftest``) so that the tests import it by name, as the launcher
tests import ``testkit.launcher``.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from kvcore import arrays
from testkit import InProcJob, LocalJob


def run_device_threads(fn, devids, join_timeout: float = 30) -> None:
    """Run ``fn(devid)`` in one thread per device and wait for all of them.

    Fails if a thread is still running after ``join_timeout`` seconds (so a stuck device cannot
    hang the test); re-raises the first error a thread raised.
    """
    errors = []

    def target(devid):
        try:
            fn(devid)
        except BaseException as exc:
            errors.append(exc)

    # daemon threads: one stuck for good (a deadlocked GPU collective) must not keep pytest alive
    threads = [threading.Thread(target=target, args=(d,), daemon=True) for d in devids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not any(t.is_alive() for t in threads), "a device thread did not finish"
    if errors:
        raise errors[0]


def run_job_ok(worker: list[str], workers: int, servers: int, env: dict | None = None, timeout: float = 60) -> list:
    """Run a job of ``worker`` argv on 127.0.0.1 and check that every process exited 0 and every
    worker printed ``OK <rank>`` (each rank once); the processes' results."""
    with LocalJob(workers, servers, worker=worker, env=env) as job:
        results = job.wait(timeout)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(str(r) for r in failed)
    oks = sorted(int(m) for r in results if r.role == "worker" for m in re.findall(r"^OK (\d+)", r.output, re.M))
    assert oks == list(range(workers)), "\n".join(str(r) for r in results)
    return results


def run_inproc_ok(worker: list[str], workers: int, servers: int, settings: dict | None = None,
                  timeout: float = 60) -> dict[int, str]:
    """Run the worker script ``worker`` (path and arguments) as every worker of a job inside this
    process (``testkit.InProcJob.run_script``: the real scheduler, servers and workers on threads,
    no processes, no sockets); every worker must print ``OK <rank>``. Each rank's output."""
    with InProcJob(workers, servers, settings=settings) as job:
        printed = job.run_script(worker[0], worker[1:], timeout)
    oks = sorted(int(m) for text in printed.values() for m in re.findall(r"^OK (\d+)", text, re.M))
    assert oks == list(range(workers)), printed
    return printed


# ---- GPU helpers: tests marked ``gpu`` skip cleanly without a GPU that runs kernels ----------------

needs_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not arrays.gpu_available(), reason=f"needs a CUDA GPU: {arrays.gpu_status()}"),
]
"""Marks of a test that needs one GPU (a list: ``pytestmark`` or ``pytest.param(..., marks=needs_gpu)``)."""

DEVICE_KINDS = [pytest.param("cpu"), pytest.param("gpu", marks=needs_gpu)]
"""Parametrize a test by where its arrays live: its CPU form always runs, its GPU form with a GPU."""


def gpu_test(fn):
    """Decorate a test that needs a GPU: marked ``gpu``, and skipped without one."""
    for mark in needs_gpu:
        fn = mark(fn)
    return fn


def gpu_ids(count: int) -> list[int]:
    """GPU ids ``0..count-1``; skips the test when fewer GPUs are present."""
    if arrays.num_gpus() < count:
        pytest.skip(f"needs {count} GPUs, found {arrays.num_gpus()}")
    return list(range(count))


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def keep_default_stream_busy(device: "arrays.Device", seconds: float) -> None:
    """Queue a kernel that spins about ``seconds`` on this thread's default stream of ``device``.

    Returns at once.

    Stands for the training kernels that a device's default stream holds while the shared model
    copies: work that waits on that stream (wrongly) waits this long. Query
    ``default_stream_busy(device)`` to see whether it still runs.
    """
    cp = arrays.cupy_module()
    with cp.cuda.Device(device.index):
        rate_khz = cp.cuda.runtime.getDeviceProperties(device.index).get("clockRate", 2_000_000)
        kernel = cp.RawKernel(_SPIN, "spin")
        kernel((1,), (1,), (np.int64(seconds * rate_khz * 1000),))  # on this thread's default stream


def default_stream_busy(device: "arrays.Device") -> bool:
    """True while work this thread queued on ``device``'s default stream has not finished."""
    cp = arrays.cupy_module()
    with cp.cuda.Device(device.index):
        return not cp.cuda.get_current_stream().done


def finish_default_stream(device: "arrays.Device") -> None:
    """Wait until ``device``'s default stream ran everything queued on it."""
    cp = arrays.cupy_module()
    with cp.cuda.Device(device.index):
        cp.cuda.get_current_stream().synchronize()
