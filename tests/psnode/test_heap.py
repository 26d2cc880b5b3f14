"""psnode.transport.message_heap: memory freed after a round of messages stays mapped for the next round.

Each case runs in a fresh interpreter (malloc's settings are the process's): it mallocs eight 1 MiB
blocks as ZeroMQ does for eight messages in flight, touches every page, frees them, and counts the
minor page faults of the later rounds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ROUNDS = """
import ctypes, json, resource, sys
from psnode.transport import message_heap
tuned = message_heap.keep_message_memory() if sys.argv[1] == "tune" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def one_round():
    blocks = [libc.malloc(1 << 20) for _ in range(8)]
    for p in blocks:
        ctypes.memset(p, 1, 1 << 20)
    for p in blocks:
        libc.free(p)
for _ in range(3):
    one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one_round()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _rounds(mode: str, **env: str) -> dict:
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=60, env=environ)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _glibc() -> bool:
    import platform

    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _glibc(), reason="the tuning is glibc's malloc's")
def test_freed_message_memory_stays_mapped_so_later_rounds_fault_no_pages_in():
    default = _rounds("default")
    tuned = _rounds("tune")
    assert tuned["tuned"] is True
    # 20 rounds of 8 MiB: glibc's defaults trim the heap after each round and fault 2048 pages per round in again
    assert default["faults"] > 20 * 1000, default
    assert tuned["faults"] < 200, tuned


@pytest.mark.skipif(not _glibc(), reason="the tuning is glibc's malloc's")
def test_a_users_own_malloc_settings_are_left_alone():
    chosen = _rounds("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert chosen["tuned"] is False and chosen["faults"] > 20 * 1000, chosen
