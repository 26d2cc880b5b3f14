"""kvcore.runtime: the one link between kvcore and this process's worker, and a whole job in one
process (``testkit.InProcJob.run_script``) built on it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvcore
from kvcore import runtime
from kvcore.stores.allreduce import AllreduceKVStore
from kvcore.stores.distributed import DistKVStore
from testkit import InProcJob

pytestmark = pytest.mark.unit


def test_each_thread_runs_as_the_worker_it_was_handed_and_gets_it_back_after():
    assert runtime.joined() is None
    with InProcJob(2, 1) as job:
        seen: dict[int, tuple] = {}

        def run(node):
            with runtime.use(node):
                kv = kvcore.create("dist_sync")
                seen[node.rank] = (runtime.worker() is node, kv.rank, runtime.collectives() is runtime.collectives(node))
            seen[node.rank] += (runtime.joined(),)

        threads = [threading.Thread(target=run, args=(w,)) for w in job.workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert seen == {0: (True, 0, True, None), 1: (True, 1, True, None)}


def test_a_store_handed_a_worker_uses_it_for_values_and_collectives():
    with InProcJob(2, 2, settings={"PSLAUNCH_BIGARRAY_BOUND": "10"}) as job:
        stores = [DistKVStore("dist_sync", worker=w) for w in job.workers]
        sums = [AllreduceKVStore(worker=w) for w in job.workers]
        assert [s.rank for s in stores] == [0, 1] and [s.num_servers for s in stores] == [2, 2]
        assert [s.collectives.worker for s in sums] == job.workers

        def step(i: int) -> None:
            stores[i].init(7, np.zeros(25, np.float32))  # split over both servers
            stores[i].push(7, np.full(25, i + 1, np.float32))
            out = np.zeros(25, np.float32)
            stores[i].pull(7, out=out)
            assert np.all(out == 3), out
            value = np.full(4, i + 1.0)
            sums[i].collectives.allreduce(value)
            assert np.all(value == 3), value

        threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads)


def test_a_script_that_fails_on_one_worker_is_reported_naming_that_worker(tmp_path):
    script = tmp_path / "fails_on_1.py"
    script.write_text("import kvcore\nkv = kvcore.create('dist_sync')\nassert kv.rank != 1, 'rank 1 fails here'\n"
                      "print('OK', kv.rank)\n")
    with InProcJob(2, 1, expect_failure=True) as job:
        with pytest.raises(AssertionError, match=r"worker 1 failed:(.|\n)*rank 1 fails here"):
            job.run_script(script, timeout=30)


def test_a_script_gets_its_arguments_and_each_worker_its_own_output(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import sys, kvcore\nkv = kvcore.create('dist_sync')\nprint('OK', kv.rank, sys.argv[1:])\n")
    with InProcJob(3, 1) as job:
        printed = job.run_script(script, ["a", "b"], timeout=30)
    assert printed == {r: f"OK {r} ['a', 'b']\n" for r in range(3)}
