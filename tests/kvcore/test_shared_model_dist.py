"""The 'dist' shared model with real processes: a scheduler, servers and workers on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("testkit")
from testkit import LocalJob  # noqa: E402

from kvcore_testkit import DEVICE_KINDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "dist_async_sum.py")


def _check(results, workers):
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(str(r) for r in failed)
    outputs = [r.output for r in results if r.role == "worker"]
    assert len(outputs) == workers
    return outputs


def _the_worker(results):
    """The result of the one worker of a single-worker job."""
    return next(r for r in results if r.role == "worker")


@pytest.mark.slow
def test_dist_async_sum_example_sums_three_workers_of_two_devices_on_one_server():
    with LocalJob(num_workers=3, num_servers=1, worker=[EXAMPLE, "1", "2", "--rounds", "4", "--timeout", "30"]) as job:
        outputs = _check(job.wait(timeout=90), 3)
    for out in outputs:
        # 4 rounds x 3 workers x 2 devices; key 1: 4 x 3 x (1 + 2)
        assert "key 0 = [24.0, 24.0, 24.0], key 1 = [36.0, 36.0, 36.0]" in out, out
        assert "ok: 3 workers x 2 devices x 4 rounds summed on the servers" in out, out


@pytest.mark.slow
def test_dist_model_with_two_servers_and_a_split_key(tmp_path):
    script = tmp_path / "split_key_worker.py"
    script.write_text(
        "import sys, threading\n"
        "import numpy as np\n"
        "import kvcore\n"
        "class Scaled(kvcore.ModelUpdater):\n"
        "    def __init__(self, scale):\n"
        "        self.scale = scale\n"
        "    def init_model(self, key, data):\n"
        "        data[...] = 1\n"
        "    def update(self, key, grad):\n"
        "        self.weight(key)[...] += grad * self.scale\n"
        "if __name__ == '__main__':\n"
        "    model = kvcore.create_shared_model('dist', updater=Scaled(0.5), device='cpu', timeout=30)\n"
        "    model.init([0, 1])\n"
        "    shape = (600, 5)  # 3000 elements: split across both servers (bound 1000)\n"
        "    w = {d: np.zeros(shape, np.float32) for d in (0, 1)}\n"
        "    for dev in (0, 1):\n"
        "        model.init_key(shape, 'w', dev)\n"
        "        model.pull_req(w[dev], 'w', dev)\n"
        "        model.pull_wait('w', dev)\n"
        "        assert np.all(w[dev] == 1), w[dev].ravel()[:4]  # init_model's start on both shards\n"
        "    model.barrier()  # nobody pushes before every worker read the start\n"
        "    errors = []\n"
        "    def run(dev):\n"
        "        try:\n"
        "            for _ in range(3):\n"
        "                model.push(np.full(shape, 2, np.float32), 'w', dev)\n"
        "                model.pull_req(w[dev], 'w', dev)\n"
        "                model.pull_wait('w', dev)\n"
        "        except BaseException as exc:\n"
        "            errors.append(exc)\n"
        "    threads = [threading.Thread(target=run, args=(d,)) for d in (0, 1)]\n"
        "    [t.start() for t in threads]\n"
        "    [t.join() for t in threads]\n"
        "    assert not errors, errors\n"
        "    model.barrier()\n"
        "    total = model.get_weight('w', 0)\n"
        "    print('TOTAL', float(total.min()), float(total.max()), model.num_workers, flush=True)\n"
        "    model.barrier()\n"
        "    model.close()\n"
    )
    env = {"PSLAUNCH_BIGARRAY_BOUND": "1000"}
    with LocalJob(num_workers=2, num_servers=2, worker=[str(script)], env=env) as job:
        outputs = _check(job.wait(timeout=90), 2)
    # start 1; each of 2 workers sends 3 rounds of (2 + 2) * 0.5 = 2
    for out in outputs:
        assert "TOTAL 13.0 13.0 2" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_dist_model_on_its_devices_pulls_exact_weights_into_strided_targets(kind):
    script = str(ROOT / "tests" / "kvcore" / "dist_scripts" / "shared_model_device.py")
    with LocalJob(num_workers=1, num_servers=1, worker=[script, kind]) as job:
        outputs = _check(job.wait(timeout=120), 1)
    assert "OK 0" in outputs[0], outputs[0]


@pytest.mark.slow
def test_dist_model_reports_a_failing_server_updater_naming_the_key(tmp_path):
    script = tmp_path / "bad_updater_worker.py"
    script.write_text(
        "import numpy as np\n"
        "import kvcore\n"
        "class Broken(kvcore.ModelUpdater):\n"
        "    def update(self, key, grad):\n"
        "        raise ValueError('no update here')\n"
        "if __name__ == '__main__':\n"
        "    with kvcore.create_shared_model('dist', updater=Broken(), device='cpu', timeout=20) as model:\n"
        "        model.init([0])\n"
        "        model.init_key((3,), 'bias', 0)\n"
        "        data = np.ones(3, np.float32)\n"
        "        model.push(data, 'bias', 0)\n"
        "        model.pull_req(data, 'bias', 0)\n"
        "        try:\n"
        "            model.pull_wait('bias', 0)\n"
        "        except kvcore.shared_model.PullFailedError as exc:\n"
        "            print('FAILED', exc, flush=True)\n"
    )
    with LocalJob(num_workers=1, num_servers=1, worker=[str(script)]) as job:
        results = job.wait(timeout=60)
    out = _the_worker(results).output
    assert "FAILED key 'bias'" in out, out
    assert "no update here" in out, out


@pytest.mark.slow
def test_pull_wait_names_the_key_when_the_server_dies(tmp_path):
    import os
    import signal
    import time

    script = tmp_path / "server_dies_worker.py"
    script.write_text(
        "import sys\n"
        "import numpy as np\n"
        "import kvcore\n"
        "from kvcore.shared_model import SumUpdater, SharedModelError\n"
        "model = kvcore.create_shared_model('dist', updater=SumUpdater(), device='cpu', timeout=20)\n"
        "model.init([0])\n"
        "model.init_key((8,), 'w', 0)\n"
        "data = np.ones(8, np.float32)\n"
        "try:\n"
        "    for step in range(100000):\n"
        "        model.push(data, 'w', 0)\n"
        "        model.pull_req(data, 'w', 0)\n"
        "        model.pull_wait('w', 0)\n"
        "        data[...] = 1\n"
        "        if step == 0:\n"
        "            print('READY', flush=True)\n"
        "except SharedModelError as exc:\n"
        "    print('FAILED', type(exc).__name__, exc, flush=True)\n"
        "    sys.exit(3)\n"
    )
    env = {"PS_HEARTBEAT_INTERVAL": "0.2", "PS_HEARTBEAT_TIMEOUT": "2"}
    with LocalJob(num_workers=1, num_servers=1, worker=[str(script)], env=env) as job:
        deadline = time.monotonic() + 30
        while "READY" not in _the_worker(job.results()).output:
            assert time.monotonic() < deadline, job.results()
            time.sleep(0.1)
        os.killpg(job.of("server").pid, signal.SIGKILL)
        job.of("worker").wait(40)
        worker = _the_worker(job.results())
    assert worker.returncode == 3, worker
    assert "FAILED PullFailedError key 'w'" in worker.output, worker.output
    assert "server" in worker.output.split("FAILED", 1)[1], worker.output


@pytest.mark.slow
def test_dist_async_sum_example_under_pslaunch():
    import importlib.util
    import os
    import signal
    import subprocess

    if importlib.util.find_spec("launcher.cli") is None:
        pytest.skip("the pslaunch launcher is not installed in this tree")
    argv = [sys.executable, "-m", "launcher.cli", "--launcher", "local", "-s", "1", "-n", "3", EXAMPLE, "1", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    # 5 rounds x 3 workers x 2 devices; key 1: 5 x 3 x (1 + 2)
    assert out.count("key 0 = [30.0, 30.0, 30.0], key 1 = [45.0, 45.0, 45.0]") == 3, out
    assert out.count("ok: 3 workers x 2 devices x 5 rounds summed on the servers") == 3, out
