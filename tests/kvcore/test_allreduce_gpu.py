"""CuPy arrays through the allreduce store and kvcore.collectives: NCCL between GPUs, host staging otherwise.

Marked ``gpu``: skipped without a CUDA GPU (``scripts/gpu_check.sh`` runs them on a machine with one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore import arrays
from kvcore_testkit import gpu_ids, gpu_test, run_job_ok

SCRIPT = Path(__file__).parent / "allreduce_scripts" / "gpu_sums.py"


def _run(mode: str, workers: int) -> None:
    run_job_ok([str(SCRIPT), mode], workers, 0, timeout=180)


@gpu_test
def test_two_workers_on_two_gpus_sum_exactly_through_nccl():
    gpu_ids(2)
    if not arrays.nccl_available():
        pytest.skip("NCCL is not usable here (libnccl missing)")
    _run("nccl", 2)


@gpu_test
def test_a_dtype_nccl_does_not_sum_is_summed_exactly_through_the_host():
    _run("staged", 2)
