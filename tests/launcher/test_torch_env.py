"""A plain torch.distributed script under pslaunch: every worker gets torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; with -s 0 MASTER_ADDR and MASTER_PORT too), so a DDP
script on gloo runs unchanged, locally and over ssh."""

from __future__ import annotations

import re
import sys

import pytest

from testkit.launcher import backend_launch, helper


@pytest.mark.parametrize("backend", ["local", "ssh"])
def test_a_torch_ddp_script_runs_unchanged_under_pslaunch_without_servers(backend, request, tmp_path):
    pytest.importorskip("torch")
    launch = backend_launch(backend, request, tmp_path)
    res = launch.run(["--no-dashboard", "-n", "2", "-s", "0", *launch.args, sys.executable, helper("ddp_gloo.py")],
                     timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    oks = sorted(re.findall(r"\] OK (\d) 2 (\d) (\d)$", res.stdout, re.M))
    # one worker per host over ssh (127.0.0.2, 127.0.0.3), both on this machine locally
    expected = [("0", "0", "1"), ("1", "0", "1")] if backend == "ssh" else [("0", "0", "2"), ("1", "1", "2")]
    assert oks == expected, res.stdout + res.stderr
