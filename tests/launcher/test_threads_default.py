"""Threads per process (torchrun's rule, with the share of cores): when several of the job's processes
run on this machine and the user set none of ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and
``OPENBLAS_NUM_THREADS``, each process gets the usable cores divided by the processes (at least 1) in
all three, and pslaunch says so in one line; a value the user set, in pslaunch's environment or with
``--env``, is left alone and nothing is said."""

from __future__ import annotations

import json
import os

import pytest

from testkit.launcher import run_pslaunch

pytestmark = pytest.mark.timeout(120)

NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
SCRIPT = """import json, os, sys
import kvcore
kv = kvcore.create("dist_sync")
with open(os.path.join(sys.argv[1], f"env.{kv.rank}.json"), "w") as fh:
    json.dump({name: os.environ.get(name) for name in %r}, fh)
""" % (NAMES,)


def _run(tmp_path, *args, env=None):
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in NAMES}
    res = run_pslaunch(["-n", "2", "-s", "1", "--no-dashboard", *args, "python", str(script), str(tmp_path)],
                       env={**base, **(env or {})}, timeout=90)
    assert res.returncode == 0, res.stderr
    return res, [json.loads((tmp_path / f"env.{rank}.json").read_text()) for rank in range(2)]


def test_processes_sharing_this_machine_get_its_cores_divided_among_them_and_one_line_says_so(tmp_path):
    res, seen = _run(tmp_path)
    each = str(max(1, len(os.sched_getaffinity(0)) // 4))  # scheduler, server, two workers
    assert all(env == {name: each for name in NAMES} for env in seen), seen
    line = (f"pslaunch: 4 processes share this machine's {len(os.sched_getaffinity(0))} cores: each gets "
            f"OMP_NUM_THREADS={each}, MKL_NUM_THREADS={each}, OPENBLAS_NUM_THREADS={each} (set OMP_NUM_THREADS "
            "to choose; docs/launcher.md)")
    assert res.stderr.count(line) == 1, res.stderr
    assert res.stderr.index(line) < res.stderr.index("pslaunch job ")  # with the summary, just before its table
    # and --dry-run shows the values and the line
    plan = run_pslaunch(["-n", "2", "-s", "1", "--dry-run", "python", str(tmp_path / "threads.py"), str(tmp_path)],
                        env={k: v for k, v in os.environ.items() if k not in NAMES}, timeout=30)
    assert plan.returncode == 0 and line.removeprefix("pslaunch: ") in plan.stdout + plan.stderr, plan.stdout
    assert (plan.stdout + plan.stderr).count(" ".join(f"{name}={each}" for name in NAMES)) == 4, plan.stdout


@pytest.mark.parametrize("how", ["environment", "--env"])
def test_a_thread_count_the_user_set_is_left_alone(tmp_path, how):
    if how == "environment":
        res, seen = _run(tmp_path, env={"OMP_NUM_THREADS": "3"})
    else:
        res, seen = _run(tmp_path, "--env", "OMP_NUM_THREADS:3")
    assert all(env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": None, "OPENBLAS_NUM_THREADS": None}
               for env in seen), seen
    assert "processes share this machine" not in res.stderr, res.stderr
