"""A plain torch.distributed script under pslaunch: every worker gets torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, whatever -s is), so a DDP
script on gloo runs unchanged, locally and over ssh, as a torchrun user first types it too."""

from __future__ import annotations

import re
import sys

import pytest

from testkit.launcher import backend_launch, helper


@pytest.mark.parametrize("servers", [["-s", "0"], []], ids=["without_servers", "default_servers"])
@pytest.mark.parametrize("backend", ["local", "ssh"])
def test_a_torch_ddp_script_runs_unchanged_under_pslaunch(backend, servers, request, tmp_path):
    # pslaunch -n 2 train_ddp.py, a torchrun user's first try, starts servers (-s defaults to -n) the
    # script never uses; it once failed with "environment variable MASTER_ADDR expected, but not set"
    pytest.importorskip("torch")
    launch = backend_launch(backend, request, tmp_path)
    res = launch.run(["--no-dashboard", "-n", "2", *servers, *launch.args, sys.executable, helper("ddp_gloo.py")],
                     timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    oks = sorted(re.findall(r"\] OK (\d) 2 (\d) (\d)$", res.stdout, re.M))
    # one worker per host over ssh (127.0.0.2, 127.0.0.3), both on this machine locally
    expected = [("0", "0", "1"), ("1", "0", "1")] if backend == "ssh" else [("0", "0", "2"), ("1", "1", "2")]
    assert oks == expected, res.stdout + res.stderr
