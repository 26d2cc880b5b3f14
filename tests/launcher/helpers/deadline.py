"""Test helpers' waits for what another process does (a file it writes, a word the runtime got): each
polls its condition until a deadline, and a worker whose condition never holds says what it waited for
and ends with exit code 3, so the test fails naming it instead of hanging."""

import os
import sys
import time


def wait_until(done, what: str, limit: float = 30.0) -> None:
    """Return once ``done()`` holds; past ``limit`` seconds print that ``what`` did not happen and exit 3."""
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            print(f"{what} did not happen within {limit:g} s (pid {os.getpid()})", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.01)
