"""The array backend picks numpy or CuPy and moves arrays between devices."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvcore import arrays

needs_gpu = pytest.mark.skipif(not arrays.gpu_available(), reason="needs a CUDA GPU with a working CuPy")


def test_cpu_device_and_spellings():
    assert arrays.cpu() == arrays.Device("cpu", 0)
    assert str(arrays.gpu(1)) == "gpu(1)"
    assert arrays.Device.parse("gpu:2") == arrays.gpu(2)
    assert arrays.Device.parse("gpu(3)") == arrays.gpu(3)
    assert arrays.Device.parse("cpu") == arrays.cpu()


def test_bad_device_spelling_names_the_text():
    with pytest.raises(ValueError, match="'tpu:0'"):
        arrays.Device.parse("tpu:0")


def test_numpy_arrays_live_on_the_cpu():
    a = np.zeros(3)
    assert arrays.device_of(a) == arrays.cpu()
    assert arrays.array_module(a) is np
    assert arrays.is_array(a) and not arrays.is_array([1, 2])


def test_to_device_cpu_returns_same_array_unless_copy():
    a = np.arange(3)
    assert arrays.to_device(a, arrays.cpu()) is a
    b = arrays.to_device(a, arrays.cpu(), copy=True)
    assert b is not a and np.array_equal(a, b)


def test_copy_into_casts_and_checks_shape():
    dst = np.zeros(3, np.float32)
    arrays.copy_into(dst, np.array([1, 2, 3], np.int64))
    assert dst.dtype == np.float32 and dst.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        arrays.copy_into(dst, np.zeros(2))


def test_zeros_and_empty_on_cpu():
    assert arrays.zeros((2, 2), np.float64).sum() == 0
    assert arrays.empty((4,), np.int32).shape == (4,)


@pytest.mark.skipif(arrays.gpu_available(), reason="checks the behaviour without a GPU")
def test_gpu_placement_without_gpu_raises_clearly():
    assert arrays.num_gpus() == 0
    with pytest.raises(RuntimeError, match=r"gpu\(0\).*no usable GPU"):
        arrays.zeros(3, device=arrays.gpu(0))


def test_cupy_that_imports_but_is_unusable_falls_back_to_numpy(tmp_path):
    # A fake `cupy` package whose is_available() is False, first on the path: the backend must
    # report no GPU and keep working on numpy rather than crash.
    fake = tmp_path / "cupy"
    fake.mkdir()
    (fake / "__init__.py").write_text("def is_available():\n    return False\n")
    code = textwrap.dedent(
        """
        import numpy as np
        from kvcore import arrays
        import kvcore
        assert arrays.cupy_module() is None
        assert arrays.num_gpus() == 0
        kv = kvcore.create('device')
        kv.init(1, np.ones(2))
        kv.push(1, [np.ones(2), np.ones(2)])
        out = np.zeros(2)
        kv.pull(1, out=out)
        print(out.tolist())
        """
    )
    env_path = f"{tmp_path}:{sys.path[0]}"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2.0, 2.0]"


def test_cupy_whose_probe_raises_falls_back_to_numpy(tmp_path):
    fake = tmp_path / "cupy"
    fake.mkdir()
    (fake / "__init__.py").write_text("def is_available():\n    raise RuntimeError('no CUDA driver')\n")
    code = "from kvcore import arrays; print(arrays.gpu_available(), arrays.num_gpus())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": f"{tmp_path}:{sys.path[0]}", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False 0"


def test_only_the_array_backend_imports_cupy():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    offenders = []
    for path in list(root.glob("kvcore/**/*.py")) + list(root.glob("psnode/**/*.py")) + list(root.glob("launcher/**/*.py")):
        text = path.read_text()
        if path.relative_to(root) != pathlib.Path("psnode/devices.py") and ("import cupy" in text or "from cupy" in text):
            offenders.append(str(path.relative_to(root)))
    assert offenders == []


@needs_gpu
def test_gpu_round_trip_and_device_store_merges_on_gpu():
    import kvcore

    cp = arrays.cupy_module()
    a = arrays.to_device(np.arange(4, dtype=np.float32), arrays.gpu(0))
    assert isinstance(a, cp.ndarray) and arrays.device_of(a) == arrays.gpu(0)
    assert np.array_equal(arrays.asnumpy(a), np.arange(4))
    kv = kvcore.create("device")
    kv.init(1, a)
    kv.push(1, [a, a])
    out = arrays.zeros(4, np.float32, arrays.gpu(0))
    kv.pull(1, out=out)
    assert arrays.device_of(kv._stored[1]).is_gpu
    assert np.array_equal(arrays.asnumpy(out), 2 * np.arange(4))


@needs_gpu
def test_local_store_merges_gpu_values_on_host():
    import kvcore

    a = arrays.to_device(np.ones(4, np.float32), arrays.gpu(0))
    kv = kvcore.create("local")
    kv.init(1, a)
    kv.push(1, [a, a])
    host = np.zeros(4, np.float32)
    kv.pull(1, out=host)
    assert not arrays.device_of(kv._stored[1]).is_gpu
    assert host.tolist() == [2, 2, 2, 2]


@needs_gpu
def test_optimizer_runs_on_gpu_arrays():
    from kvcore import optim

    w = arrays.to_device(np.ones(3, np.float32), arrays.gpu(0))
    g = arrays.to_device(np.ones(3, np.float32), arrays.gpu(0))
    optim.Updater(optim.Adam(learning_rate=0.1))(0, g, w)
    assert np.allclose(arrays.asnumpy(w), 0.9)
