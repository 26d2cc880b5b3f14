"""The array backend picks numpy or CuPy and moves arrays between devices."""

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvcore import arrays

ROOT = Path(__file__).resolve().parents[2]


def needs_gpu(test):
    """Marked ``gpu`` (scripts/gpu_check.sh runs those) and skipped without a GPU that runs kernels."""
    skip = pytest.mark.skipif(not arrays.gpu_available(), reason=f"needs a CUDA GPU: {arrays.gpu_status()}")
    return pytest.mark.gpu(skip(test))


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


# A fake `cupy` package, first on the path, plays a CuPy that imports but cannot run here. Each
# names its own failure; the parts a case does not replace behave like a working CuPy with one GPU.
_FAKE_CUPY = """
import numpy
__version__ = "99.0-fake"
float32 = numpy.float32
{imports}
class _Runtime:
    def getDeviceCount(self):
        {count}
class _Device:
    def __init__(self, index):
        self.index = index
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return None
class cuda:
    runtime = _Runtime()
    Device = _Device
def arange(n, dtype=None):
    {arange}
"""

_PROBE_FAILURES = {
    "import": (dict(imports="raise ImportError('libcudart.so.12: cannot open shared object file')"),
               r"CuPy is installed but does not import: ImportError: libcudart\.so\.12"),
    "driver": (dict(count="raise RuntimeError('cudaErrorInsufficientDriver: CUDA driver version is insufficient')"),
               r"CuPy 99\.0-fake finds no usable CUDA driver: RuntimeError: cudaErrorInsufficientDriver"),
    "no device": (dict(count="return 0"), r"CuPy 99\.0-fake sees no GPU"),
    "no nvrtc": (dict(arange="raise RuntimeError('CompileException: cannot load libnvrtc.so.12')"),
                 r"CuPy 99\.0-fake cannot run a kernel on GPU 0: RuntimeError: CompileException: cannot load libnvrtc"),
    "wrong sum": (dict(arange="return numpy.zeros(n, dtype)"),
                  r"CuPy 99\.0-fake computed 0\.0 instead of 1047552\.0 on GPU 0"),
}


@pytest.mark.parametrize("failure", list(_PROBE_FAILURES))
def test_a_cupy_that_cannot_run_a_kernel_means_numpy_and_one_line_saying_why(tmp_path, failure):
    parts, reason = _PROBE_FAILURES[failure]
    fake = tmp_path / "cupy"
    fake.mkdir()
    fields = {"imports": "", "count": "return 1", "arange": "return numpy.arange(n, dtype=dtype)", **parts}
    (fake / "__init__.py").write_text(_FAKE_CUPY.format(**fields))
    code = textwrap.dedent(
        """
        import numpy as np
        import kvcore
        from kvcore import arrays
        assert arrays.cupy_module() is None and not arrays.gpu_available() and arrays.num_gpus() == 0
        kv = kvcore.create('device')
        kv.init(1, np.ones(2))
        kv.push(1, [np.ones(2), np.ones(2)])
        out = np.zeros(2)
        kv.pull(1, out=out)
        print(out.tolist())
        print(arrays.gpu_status())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    sums, status = result.stdout.strip().splitlines()
    assert sums == "[2.0, 2.0]"
    assert re.match(reason, status), status
    # the same line once on stderr, as a warning: the probe ran once although asked four times
    warnings = [line for line in result.stderr.splitlines() if "GpuUnavailableWarning" in line]
    assert len(warnings) == 1 and status in warnings[0], result.stderr


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_the_status_says_it_is_not_installed_and_nothing_warns(recwarn):
    assert arrays.gpu_status().startswith("CuPy is not installed")
    assert not [w for w in recwarn if issubclass(w.category, arrays.GpuUnavailableWarning)]


@pytest.mark.skipif(
    importlib.util.find_spec("cupy") is None or arrays.gpu_available(),
    reason="for a real CuPy installed on a machine where it cannot run (no driver, no GPU, no NVRTC)",
)
def test_a_real_cupy_that_cannot_run_here_names_its_version_and_the_cause():
    import cupy

    assert arrays.num_gpus() == 0
    assert arrays.gpu_status().startswith(f"CuPy {cupy.__version__} "), arrays.gpu_status()


def test_nccl_dtypes_include_the_unsigned_ints_and_leave_out_what_nccl_lacks():
    for dtype in (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64):
        assert arrays.nccl_supports(dtype), dtype
    for dtype in (np.bool_, np.int16, np.uint16, np.complex64):
        assert not arrays.nccl_supports(dtype), dtype


@pytest.mark.skipif(arrays.nccl_available(), reason="checks the error where NCCL is not usable")
def test_an_nccl_group_where_nccl_is_not_usable_says_why():
    with pytest.raises(RuntimeError, match="NCCL is not usable here: .*nvidia-nccl-cu12"):
        arrays.NcclGroup([0, 1])


def test_copy_into_handles_strided_arrays_on_the_host():
    dst = np.zeros((4, 6), np.float32)
    src = np.arange(24, dtype=np.int64).reshape(6, 4).T  # a transposed (strided) view
    arrays.copy_into(dst[:, ::2], src[:, :3])
    np.testing.assert_array_equal(dst[:, ::2], src[:, :3])
    assert not dst[:, 1::2].any()


def test_only_the_array_backend_imports_cupy():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    offenders = []
    for path in list(root.glob("kvcore/**/*.py")) + list(root.glob("psnode/**/*.py")) + list(root.glob("launcher/**/*.py")):
        text = path.read_text()
        if path.relative_to(root) != pathlib.Path("psnode/devices/__init__.py") and ("import cupy" in text or "from cupy" in text):
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
