"""The training examples, run for real as subprocesses, reach the accuracy the project promises.

One worker with the local store runs now; the two-worker runs go through ``pslaunch --launcher local``
with the bundled runtime and skip until both the launcher and the runtime are present.
"""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
LINE = re.compile(r"worker (\d+) epoch (\d+) test_accuracy ([0-9.]+)")
FINAL = re.compile(r"worker (\d+) final test_accuracy ([0-9.]+) wall_time ([0-9.]+)")
THRESHOLD = 0.95
EPOCHS = 8
RESNET_EPOCHS = 3
RESNET_THRESHOLD = 0.5
HAVE_RUNTIME_AND_LAUNCHER = (ROOT / "launcher" / "cli.py").is_file() and (ROOT / "psnode" / "__main__.py").is_file()
needs_pslaunch = pytest.mark.skipif(
    not HAVE_RUNTIME_AND_LAUNCHER, reason="needs launcher/cli.py and psnode/__main__.py (the launcher and the runtime)"
)


def _clean_env():
    """This environment without any job contract: a DMLC_* left over would make the examples join a job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(argv, timeout):
    """Run ``argv`` in its own process group; kill the whole group on timeout or failure of the test."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, argv))} ran past {timeout} s; output:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"exit code {proc.returncode}; output:\n{out[-4000:]}"
    # A worker may exit while a child of the group lingers: nothing may outlive the run.
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        pass
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"processes of {argv[1:3]} outlived the run")
    return out


def _accuracies(out):
    """``{worker: [accuracy per epoch]}`` parsed from the output (pslaunch prefixes do not matter)."""
    result = {}
    for match in LINE.finditer(out):
        worker, epoch, acc = int(match.group(1)), int(match.group(2)), float(match.group(3))
        curve = result.setdefault(worker, [])
        assert epoch == len(curve), f"worker {worker} printed epoch {epoch} after {len(curve)} epochs:\n{out}"
        curve.append(acc)
    return result


def _train(script, *args, timeout=120):
    out = _run([sys.executable, str(EXAMPLES / script), "--epochs", str(EPOCHS), *args], timeout)
    curves = _accuracies(out)
    assert list(curves) == [0], out
    assert len(curves[0]) == EPOCHS, out
    assert FINAL.search(out), out
    return curves[0]


def test_train_mlp_with_the_local_store_reaches_the_threshold():
    curve = _train("train_mlp.py", "--kvstore", "local")
    assert curve[-1] >= THRESHOLD, curve
    assert curve[-1] > curve[0]


def test_train_mlp_two_devices_follow_the_one_device_trajectory():
    # The batch split across two devices and summed through the store is the same step as one device's.
    one = _train("train_mlp.py", "--kvstore", "local", "--devices", "cpu")
    two = _train("train_mlp.py", "--kvstore", "local", "--devices", "cpu,cpu", "--update-on", "store")
    assert max(abs(a - b) for a, b in zip(one, two)) <= 0.005, (one, two)
    assert two[-1] >= THRESHOLD


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch-size", "63", "--devices", "cpu,cpu"], "--batch-size 63 must be a multiple of 1 workers x 2 devices"),
        (["--devices", "gpu:99"], "gpu(99) not available"),
        (["--devices", "tpu"], "cannot parse device 'tpu'"),
    ],
)
def test_train_mlp_refuses_bad_flags_with_one_line_and_exit_code_2(args, message):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_mlp.py"), "--epochs", "1", *args],
                          cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_torch_train_with_the_local_store_reaches_the_threshold():
    pytest.importorskip("torch", reason="the torch extra is not installed: pip install -e '.[torch]'")
    curve = _train("torch_train.py", "--kvstore", "local")
    assert curve[-1] >= THRESHOLD, curve


def _job_processes(job_id):
    """Pids of live processes whose environment carries ``PSLAUNCH_JOB_ID=job_id``."""
    marker = f"PSLAUNCH_JOB_ID={job_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def _pslaunch(script, workers, *args, timeout=240, servers=2, epochs=EPOCHS):
    job_id = f"training-e2e-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "launcher.cli", "--launcher", "local", "-n", str(workers), "-s", str(servers),
            "--job-id", job_id, "--timeout", str(timeout - 30),
            "--", sys.executable, str(EXAMPLES / script), "--epochs", str(epochs), *args]
    try:
        out = _run(argv, timeout)
    finally:
        leftovers = _job_processes(job_id)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes of job {job_id} outlived pslaunch: {leftovers}"
    curves = _accuracies(out)
    assert sorted(curves) == list(range(workers)), out
    assert all(len(c) == epochs for c in curves.values()), out
    return curves


@needs_pslaunch
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers", [2, 0], ids=["two-servers", "allreduce-no-servers"])
def test_train_mlp_two_workers_matches_one_worker_through_pslaunch(servers):
    one = _train("train_mlp.py", "--kvstore", "local")
    curves = _pslaunch("train_mlp.py", 2, servers=servers)
    for worker, curve in curves.items():
        assert curve[-1] >= THRESHOLD, (worker, curve)
        assert abs(curve[-1] - one[-1]) <= 0.01, (worker, curve, one)
    # Every worker holds the same weights after each step, so they agree on every epoch.
    assert curves[0] == curves[1], curves


@needs_pslaunch
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_mlp_two_workers_updating_on_the_workers_through_pslaunch():
    curves = _pslaunch("train_mlp.py", 2, "--update-on", "worker")
    assert all(c[-1] >= THRESHOLD for c in curves.values()), curves
    assert curves[0] == curves[1], curves


@needs_pslaunch
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_train_two_workers_through_pslaunch_with_and_without_servers():
    pytest.importorskip("torch", reason="the torch extra is not installed: pip install -e '.[torch]'")
    with_servers = _pslaunch("torch_train.py", 2)
    without = _pslaunch("torch_train.py", 2, servers=0)  # the allreduce store: the same script, -s 0
    for curves in (with_servers, without):
        assert all(c[-1] >= THRESHOLD for c in curves.values()), curves
        assert curves[0] == curves[1], curves
    assert abs(with_servers[0][-1] - without[0][-1]) <= 0.01, (with_servers, without)


def _synthetic_cifar():
    """examples/synthetic_cifar.py as a module (the examples directory is not a package)."""
    spec = importlib.util.spec_from_file_location("synthetic_cifar", EXAMPLES / "synthetic_cifar.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_synthetic_cifar_is_a_pure_function_of_its_seed_with_balanced_classes():
    load = _synthetic_cifar().load_synthetic_cifar
    x_train, y_train, x_test, y_test = load(seed=3, train_size=200, test_size=50)
    assert x_train.shape == (200, 3, 32, 32) and x_test.shape == (50, 3, 32, 32)
    assert x_train.dtype == x_test.dtype == np.float32
    assert y_train.dtype == y_test.dtype == np.int64
    assert np.bincount(y_train, minlength=10).tolist() == [20] * 10
    assert np.bincount(y_test, minlength=10).tolist() == [5] * 10
    again = load(seed=3, train_size=200, test_size=50)
    assert all(np.array_equal(a, b) for a, b in zip((x_train, y_train, x_test, y_test), again))
    other = load(seed=4, train_size=200, test_size=50)
    assert not np.array_equal(x_train, other[0])
    with pytest.raises(ValueError, match="train_size must be a positive multiple of 10"):
        load(train_size=205)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--compression", "2bit"], "--compression 2bit: Gradient compression is not supported for this type of "
                                    "kvstore ('local')"),
        (["--ddp"], "--ddp needs torchrun's variables"),
        (["--ddp-hook", "powersgd"], "--ddp-hook applies to --ddp"),
        (["--ddp", "--compression", "fp16"], "--compression applies to kvcore's stores, not to --ddp"),
        (["--train-size", "1005"], "train_size must be a positive multiple of 10"),
    ],
)
def test_train_resnet_refuses_bad_flags_with_one_line_and_exit_code_2(args, message):
    pytest.importorskip("torch", reason="the torch extra is not installed: pip install -e '.[torch]'")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_resnet.py"), "--epochs", "1", *args],
                          cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@needs_pslaunch
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers", [2, 0], ids=["two-servers", "allreduce-no-servers"])
def test_train_resnet_two_workers_learn_the_synthetic_images_through_pslaunch(servers):
    pytest.importorskip("torch", reason="the torch extra is not installed: pip install -e '.[torch]'")
    # A short run (3 epochs of 2,000 images, 93 steps): far from the example's final accuracy, far above chance (0.1).
    curves = _pslaunch("train_resnet.py", 2, "--train-size", "2000", "--test-size", "500", servers=servers,
                       epochs=RESNET_EPOCHS)
    for worker, curve in curves.items():
        assert curve[-1] >= RESNET_THRESHOLD, (worker, curve)
        assert curve[-1] > curve[0], (worker, curve)


@needs_pslaunch
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers, flags", [
    (2, ["--compression", "fp16"]),
    (2, ["--compression", "topk", "--compression-ratio", "0.1", "--momentum-correction", "--compression-pull", "bf16"]),
    (0, ["--compression", "1bit_scaled", "--momentum-correction"]),
], ids=["fp16-two-servers", "topk-momentum-bf16-pulls", "1bit_scaled-allreduce"])
def test_train_mlp_two_workers_learn_with_gradient_compression_through_pslaunch(servers, flags):
    curves = _pslaunch("train_mlp.py", 2, *flags, servers=servers)
    for worker, curve in curves.items():
        assert curve[-1] >= THRESHOLD, (worker, curve)
    assert curves[0] == curves[1], curves  # the same pulls (servers) or the same sums (allreduce): the same weights


@needs_pslaunch
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_train_resnet_under_ddp_runs_with_ddps_communication_hooks(hook):
    pytest.importorskip("torch", reason="the torch extra is not installed: pip install -e '.[torch]'")
    # PowerSGD starts after 2 plain steps of the run's 15, so its compressed steps run too
    curves = _pslaunch("train_resnet.py", 2, "--train-size", "1000", "--test-size", "100", "--ddp", "--ddp-hook", hook,
                       "--powersgd-start", "2", servers=0, epochs=1)
    assert sorted(curves) == [0, 1] and all(len(c) == 1 for c in curves.values()), curves


def test_local_sum_example_prints_the_sums():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "local_sum.py"), "0", "1", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ok: every device holds row 0 = 3 and row 1 = 3" in proc.stdout
    assert proc.stdout.count("[[3. 3. 3.]\n [3. 3. 3.]]") == 3
