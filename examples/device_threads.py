"""One thread per device, as the shared-model examples run their devices.

The examples directory is not a package: a script here imports this module by name (Python puts
the script's own directory first on ``sys.path``).
"""

from __future__ import annotations

import threading


def run_device_threads(fn, devids, on_error=None) -> list[BaseException]:
    """Run ``fn(devid)`` in a thread per device id (named ``dev<id>``) and wait for every thread.

    Blocks until all threads end. Returns the errors the threads raised, in the order they were
    raised (empty when all went well), for the caller to report with its own words. ``on_error(exc)``,
    when given, runs in the failing thread right away: e.g. to abort a barrier the other devices
    would otherwise wait on forever.
    """
    errors: list[BaseException] = []

    def target(devid):
        try:
            fn(devid)
        except BaseException as exc:  # handed to the caller, which reports it
            errors.append(exc)
            if on_error is not None:
                on_error(exc)

    threads = [threading.Thread(target=target, args=(d,), name=f"dev{d}") for d in devids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
