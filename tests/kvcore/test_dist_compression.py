"""Gradient compression on the dist stores: compressed pushes over the wire, MXNet 1.9.1's bits.

Whole jobs inside this process (``InProcJob``: the real scheduler, two servers and three workers on
threads, over the in-process transport; ``tests/test_compression_wire_smoke.py`` runs compressed
pushes between processes over TCP). The
MXNET_DIST digests were made by MXNet 1.9.1 itself: ``dist_scripts/compression_rounds.py`` run
with MXNet's Python as ``compression_rounds.py mxnet <threshold>`` in a job of MXNet's scheduler and
servers (3 workers, 2 servers, ``MXNET_KVSTORE_BIGARRAY_BOUND=100000`` so the 250,007-element key is
split over both), and frozen here: CI has no MXNet. The same script under kvcore must print the
same digests, and checks every pull against its own float32 reference as it goes.

With three workers a round's sum of +-t and 0 is the same in any arrival order, so MXNet's bits are
well defined; thresholds are ones whose float32 survives MXNet's 6-decimal copy on its servers
(docs/compression.md says where the two differ).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from kvcore_testkit import run_inproc_ok

from kvcore.stores.sharding import layout

SCRIPTS = Path(__file__).parent / "dist_scripts"
pytestmark = pytest.mark.unit

SPLIT_BOUND = {"PSLAUNCH_BIGARRAY_BOUND": "100000"}

# threshold -> key -> sha256 prefix of the value pulled after push 0, 1, 2, 3 (keys: 3 of 1 element,
# 4 of 17, 5 of 1000 pushed as a list of two values, 6 of 250,007 split over the servers)
MXNET_DIST = {
    "0.5": {
        3: ["d99e58435243d9fe", "d99e58435243d9fe", "d99e58435243d9fe", "df3f619804a92fdb"],
        4: ["46d8be37e89c0ac7", "04fb33b805179d88", "217cd56c184a97eb", "f6b0655f5160755a"],
        5: ["deec827f4b502ca9", "337186716a224fa4", "91f9b1b890032394", "946d7728d6606135"],
        6: ["e56ff1762d3ba452", "542dafc993d5103c", "1d7e4b81b624260e", "759de1791363c7cb"],
    },
    # 3 x 0.1 rounds in float32: 13,388 elements of key 6 hold fl(fl(2t) + t) after push 0
    "0.1": {
        3: ["c0163c2ecd64a0a1", "5d96a77c55b4ac1e", "fb360f7241a770dc", "fb360f7241a770dc"],
        4: ["0ba359bd3114a515", "1d4a1a5c54d31f58", "39612c45e4f471bc", "dbf4dc5ebab617d9"],
        5: ["e842d5caa4a3cb1a", "1fcd0b4cc01aa7d1", "1112f37ca695638d", "507e48a2b71abad5"],
        6: ["c77faadf967e8b7c", "f21421b4389fa1ef", "5245518b5163ac61", "7671a2f138b3b1b6"],
    },
}


def run_workers(args: list[str], workers: int = 3, servers: int = 2) -> dict[int, str]:
    """Run the dist script ``args`` as every worker of a job inside this process (``InProcJob``);
    every worker must print OK. Each rank's output."""
    return run_inproc_ok([str(SCRIPTS / args[0]), *args[1:]], workers, servers, SPLIT_BOUND)


@pytest.mark.parametrize("threshold", sorted(MXNET_DIST))
def test_dist_sync_2bit_with_3_workers_and_2_servers_pulls_mxnets_bits_for_small_listed_and_split_keys(threshold):
    workers = run_workers(["compression_rounds.py", "kvcore", threshold])
    for rank, output in workers.items():
        pulled: dict[int, list[str]] = {}
        for key, step, digest in re.findall(r"^DIGEST (\d+) (\d+) (\w+)$", output, re.M):
            pulled.setdefault(int(key), []).append(digest)
        assert pulled == MXNET_DIST[threshold], f"worker {rank}"


@pytest.mark.parametrize("store", ["dist_sync", "dist_async", "dist_device_sync"])
def test_compressed_pushes_pushpull_and_parameter_changes_are_exact_against_a_float32_reference(store):
    run_workers(["compression_features.py", store])


def test_keys_split_for_compressed_pushes_fall_on_whole_words_and_on_rows_when_they_can():
    f32 = np.dtype(np.float32)
    plain = layout("k", (250_007,), f32, 2, 100_000)
    assert [p.start for p in plain.parts] == [0, 125_003]  # anywhere without compression
    flat = layout("k", (250_007,), f32, 2, 100_000, word=16)
    assert [(p.start, p.stop) for p in flat.parts] == [(0, 124_992), (124_992, 250_007)]  # 7812 + 7814 words
    assert [p.id for p in flat.parts] == [p.id for p in plain.parts]
    rows = layout("r", (4000, 30), f32, 2, 100_000, word=16)  # a block of 8 rows is 240 values = 15 words
    assert [(p.start, p.stop) for p in rows.parts] == [(0, 60_000), (60_000, 120_000)] and rows.row_size == 30
    few = layout("r", (3, 50_000), f32, 4, 100_000, word=32)  # 3 rows for 4 parts: whole 1bit words instead
    assert [p.start % 32 for p in few.parts] == [0] * 4 and few.row_size == 0 and few.parts[-1].stop == 150_000
    tiny = layout("t", (40,), f32, 4, 10, word=16)  # 3 words: never an empty part
    assert [(p.start, p.stop) for p in tiny.parts] == [(0, 16), (16, 32), (32, 40)]
