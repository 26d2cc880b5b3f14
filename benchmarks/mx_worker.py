"""Benchmark worker for MXNet 1.9.1's ``dist_sync`` KVStore (the baseline).

Run by ``benchmarks/run.py`` with the Python of a virtual environment that holds mxnet 1.9.1, under
the DMLC_* variables of a ps-lite job; argv[1] is the ``kv_suite.Plan`` as JSON. Prints one
``RESULT`` line.

MXNet reuses a pushed CPU array as its communication buffer, so later pulls overwrite the pushed
array and the pulled value grows round after round; the suite records it, the driver does not
check it for MXNet.
"""

from __future__ import annotations

import sys

import mxnet as mx

import kv_suite


class MXNetAdapter:
    """``kv_suite.KVAdapter`` over ``mx.kv.create('dist_sync')``."""

    def __init__(self) -> None:
        self._kv = mx.kv.create("dist_sync")
        self.rank = self._kv.rank
        self.num_workers = self._kv.num_workers

    def ones(self, n):
        return mx.nd.ones((n,), dtype="float32")

    def zeros(self, n):
        return mx.nd.zeros((n,), dtype="float32")

    def init(self, key, value):
        self._kv.init(key, value)

    def push(self, key, value):
        self._kv.push(key, value)

    def pull(self, key, out):
        self._kv.pull(key, out=out)
        # pull is asynchronous in MXNet's engine; waitall covers one array and lists alike
        mx.nd.waitall()

    def barrier(self):
        self._kv._barrier()

    def first(self, arr):
        return float(arr.asnumpy().ravel()[0])


def main() -> None:
    plan = kv_suite.Plan.from_json(sys.argv[1])
    adapter = MXNetAdapter()
    result = kv_suite.run_suite(adapter, plan)
    result["system"] = f"mxnet {mx.__version__}"
    kv_suite.emit_result(result)


if __name__ == "__main__":
    main()
