"""The ssh backend against a real sshd on 127.0.0.1-3 (see conftest.sshd)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import PSLAUNCH, REPO, helper, processes_with, run_pslaunch, wait_gone

TRICKY = ["--lr", "0.1 x", "it's", 'say "hi"', "$HOME", "back\\slash", "*", "", "new\nline", "ü"]


def _records(out):
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_ssh_job_places_roles_on_loopback_hosts_with_contract_and_exact_arguments(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2 slots=1", f"{sshd.user}@127.0.0.3 slots=1"])
    out = tmp_path / "out"
    res = run_pslaunch(["-n", "2", "-s", "2", "-H", hosts, *sshd.ssh_flags(), "--command-for-all-roles",
                        "--shutdown-grace", "0.5", "--env-server", "SLEEP_scheduler:forever",
                        "--env-server", "SLEEP_server=forever", "--env", "CHECK_VARS:CHECK_VARS", sys.executable, helper("role.py"), str(out), *TRICKY])
    assert res.returncode == 0, res.stderr
    rec = _records(out)
    assert sorted(rec) == ["scheduler.0", "server.0", "server.1", "worker.0", "worker.1"]
    for r in rec.values():
        assert r["argv"] == TRICKY
        assert r["env"]["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert r["env"]["DMLC_NUM_WORKER"] == "2" and r["env"]["DMLC_NUM_SERVER"] == "2"
    assert rec["worker.0"]["env"]["DMLC_NODE_HOST"] == "127.0.0.2"
    assert rec["worker.1"]["env"]["DMLC_NODE_HOST"] == "127.0.0.3"
    assert "[worker.1@127.0.0.3] worker 1 started" in res.stdout
