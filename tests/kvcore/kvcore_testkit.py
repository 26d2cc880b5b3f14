"""Helpers shared by the shared-model tests.

A module with its own name (not ``conftest``) so that the tests import it by name, as the launcher
tests import ``launcher_testkit``.
"""

from __future__ import annotations

import threading


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

    threads = [threading.Thread(target=target, args=(d,)) for d in devids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not any(t.is_alive() for t in threads), "a device thread did not finish"
    if errors:
        raise errors[0]
