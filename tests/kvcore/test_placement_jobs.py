"""Placement by bytes in real jobs (processes, ZeroMQ over TCP): any number of keys in one init
call, any order and grouping of init calls on each worker, any subset of keys per worker; every
worker agrees on each key's server, every sum is exact, and the servers carry even bytes as
``--summary-json`` reports them (``kvcore.stores.placement``, ``kvcore.stores.placement_book``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvcore_testkit import run_job_ok

from testkit.launcher import run_pslaunch

SCRIPT = str(Path(__file__).parent / "dist_scripts" / "placement_calls.py")


@pytest.mark.parametrize("servers", [2, 1])
def test_100000_keys_in_one_init_call_are_pushed_and_pulled_exactly(servers):
    # worker 0 once sent every key's place in one barrier note, past the scheduler's 256 KiB limit;
    # on one server each push, pull and reply of the 100,000 parts is cut at 65,536 records
    run_job_ok([SCRIPT, "one-call", "ones:100000"], workers=2, servers=servers, env={"PSLAUNCH_SAME_HOST": "tcp"},
               timeout=240)


@pytest.mark.parametrize("servers", [4, 8])
@pytest.mark.parametrize("model", ["ResNet-50", "100 random keys"])
def test_one_key_per_call_in_opposite_orders_sums_exactly_and_the_servers_hold_even_bytes(tmp_path, model, servers):
    summary = tmp_path / "summary.json"
    res = run_pslaunch(["-n", "2", "-s", str(servers), "--summary-json", str(summary), "--env",
                        "PSLAUNCH_SAME_HOST:tcp", "python", SCRIPT, "per-call-opposite", model], timeout=240,
                       env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert res.returncode == 0, res.stderr[-4000:]
    assert sorted(line.split()[-1] for line in res.stdout.splitlines() if " OK " in f" {line} ") == ["0", "1"], res.stdout
    held = [p["held_bytes"] for p in json.loads(summary.read_text())["processes"] if p["role"] == "server"]
    assert len(held) == servers and all(isinstance(h, int) and h > 0 for h in held), held
    assert max(held) / (sum(held) / servers) <= 1.05, held  # by key hash: 1.13-1.48
